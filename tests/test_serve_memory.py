"""`symphony serve` on a kernel with almost no KV memory: a request that cannot get its
pages is a 503 in OpenAI's shape, nothing is left behind, and the server goes on serving
requests that fit."""

from __future__ import annotations

import openai
import pytest
from daemon import meminfo

DAEMON_FLAGS = ("--kv-pages", "8", "--host-pages", "0")
SERVE_FLAGS = ("--prefix-cache-pages", "0")


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_past_the_kernel_s_memory_is_a_503_and_the_server_goes_on(server, daemon,
                                                                            stream):
    """Streamed too: the first token is awaited before the headers, so the status is 503
    rather than a 200 and an error event."""
    with daemon.connect() as k:
        info = k.model_info()
        used = meminfo(k)["device_used"]
        too_many = 9 * info.page_size  # nine pages' worth: one more than the whole pool
        assert too_many + 16 <= info.context_length  # within the context: not a 400
        with pytest.raises(openai.APIStatusError) as e:
            server.client.completions.create(model=info.name, prompt=[7] * too_many,
                                             max_tokens=4, temperature=0, stream=stream)
        assert e.value.status_code == 503
        error = e.value.body
        assert error["type"] == "overloaded_error" and "KV memory" in error["message"]
        assert meminfo(k)["device_used"] == used  # nothing held
        fits = server.client.completions.create(model=info.name, prompt=[7] * 8,
                                                max_tokens=4, temperature=0)
        assert fits.usage.completion_tokens == 4
