"""Fake `vllm serve` for CPU tests of speclab.gpubench's serve engines: /health, /version,
/metrics (spec-decode counters) and streaming /v1/completions of token-id prompts, whose
greedy output follows the fixture's bigram and whose counters follow
realshape.expected_counters (FAKE_VLLM_GRAPHED_DRAFT_REJECTS=1 as in the fake LLM)."""
import argparse
import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main(argv=None):
    from speclab.fixtures import realshape

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--speculative-config", default=None)
    a, _ = ap.parse_known_args(argv)
    spec = json.loads(a.speculative_config) if a.speculative_config else {}
    k = spec.get("num_speculative_tokens", 0)
    rejects = (k and not spec.get("enforce_eager")
               and os.environ.get("FAKE_VLLM_GRAPHED_DRAFT_REJECTS") == "1")
    succ = realshape.successors(a.model)
    tot = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
           "per_pos": [0] * k}
    lock = threading.Lock()
    print("Using 'MARLIN' Mxfp4 MoE backend (fake serve)", flush=True)

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args):
            pass

        def _send(self, body: str, ctype="application/json"):
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.end_headers()
            self.wfile.write(body.encode())

        def do_GET(self):
            if self.path == "/version":
                return self._send(json.dumps({"version": "0.0-fake"}))
            if self.path == "/metrics":
                p = "vllm:spec_decode_"
                lines = []
                with lock:
                    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                        lines += [f"# TYPE {p}{name} counter", f"{p}{name}_total {tot[name]}"]
                    lines.append(f"# TYPE {p}num_accepted_tokens_per_pos counter")
                    lines += [f'{p}num_accepted_tokens_per_pos_total{{position="{i}"}} {v}'
                              for i, v in enumerate(tot["per_pos"])]
                return self._send("\n".join(lines) + "\n", "text/plain")
            return self._send("")  # /health

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ids, n = list(body["prompt"]), body["max_tokens"]
            out = realshape.greedy(succ, ids, n)
            if k and n > 1:
                c = realshape.expected_counters(succ, [ids], k, n)
                with lock:
                    for name in ("num_drafts", "num_draft_tokens"):
                        tot[name] += c[name]
                    if not rejects:
                        tot["num_accepted_tokens"] += c["num_accepted_tokens"]
                        tot["per_pos"] = [a + b for a, b in zip(tot["per_pos"],
                                                                  c["accepted_per_pos"])]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for t in out:
                time.sleep(0.001)
                chunk = {"choices": [{"index": 0, "text": "", "token_ids": [t]}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            usage = {"prompt_tokens": len(ids), "completion_tokens": len(out)}
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

    for sig in (signal.SIGINT, signal.SIGTERM):  # a job started with `&` inherits SIGINT ignored
        signal.signal(sig, lambda *_: os._exit(0))
    ThreadingHTTPServer((a.host, a.port), H).serve_forever()


if __name__ == "__main__":
    main()
