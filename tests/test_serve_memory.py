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


@pytest.mark.parametrize("big_first", [False, True])
def test_a_streamed_batch_with_one_prompt_past_memory_is_a_503(server, daemon, big_first):
    """Every prompt's first token is awaited before the headers, not only whichever
    prompt answers first: a batch whose small prompt starts at once and whose big one the
    kernel cannot take is a 503 however they are ordered, never a 200 and an error
    event."""
    with daemon.connect() as k:
        info = k.model_info()
        small, big = [7] * 4, [7] * (9 * info.page_size)
        prompts = [big, small] if big_first else [small, big]
        used = meminfo(k)["device_used"]
        for _ in range(3):  # the small prompt's token may come before the refusal or not
            with pytest.raises(openai.APIStatusError) as e:
                stream = server.client.completions.create(
                    model=info.name, prompt=prompts, max_tokens=4, temperature=0,
                    stream=True)
                list(stream)  # a 200's events; an error event raises openai.APIError
            assert e.value.status_code == 503, e.value
            assert e.value.body["type"] == "overloaded_error"
            # The small prompt's file too is closed (its pages freed) by the time the
            # refusal is sent: the request's generations are closed before it.
            assert meminfo(k)["device_used"] == used
