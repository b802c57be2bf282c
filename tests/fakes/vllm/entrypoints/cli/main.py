"""Fake `vllm serve MODEL ...`: the fake api_server with `--model MODEL`."""
import sys

from vllm.entrypoints.openai import api_server

if __name__ == "__main__":
    _, model, *rest = sys.argv[1:]  # "serve", MODEL, flags
    api_server.main(["--model", model, *rest])
