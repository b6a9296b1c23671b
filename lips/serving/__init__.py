"""The OpenAI-compatible server's parts (lips/openai_server.py is the program): the HTTP
protocol, one request's generation over the syscalls, the prefix cache, the metrics."""
