"""A small OpenAI-compatible chat server over a tiny target, for tests and the demo of `regenerate`.

    python -m tools.tiny_server --target DIR [--port 0] [--fail-requests 3,7] [--delay-requests 2:5]

Serves POST /v1/chat/completions (non-streaming), GET /v1/models and GET /health on 127.0.0.1.
The prompt is the checkpoint's chat template with a generation prompt (`chat_template_kwargs:
{enable_thinking}` as vLLM and SGLang take it); decoding is greedy at temperature 0, else sampled
with the request's seed, until the end-of-turn token or max_tokens. With thinking on, the text
before </think> is returned as `reasoning_content` (as vLLM's Qwen3 reasoning parser does).
Concurrent requests are batched: every step runs one packed forward over all active sequences (no
KV cache: the tiny target re-reads each sequence; fine at this size).

Fault injection for tests, counting chat requests from 1 in arrival order: --fail-requests answers
the listed ones with HTTP 500, --delay-requests N:S waits S seconds before serving request N,
--hang-after N never answers requests after the Nth (until the server stops).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import click
import numpy as np
import torch

from extract.chat import load_tokenizer
from extract.model import TargetModel
from shards.cli_options import CONTEXT_SETTINGS

logger = logging.getLogger(__name__)


@dataclass
class Faults:
    fail_requests: frozenset[int] = frozenset()  # request numbers answered with HTTP 500
    delay_s: dict[int, float] = field(default_factory=dict)  # request number -> seconds to wait first
    hang_after: int | None = None  # requests after this number never get an answer


@dataclass
class _Job:
    prompt: list[int]
    max_tokens: int
    temperature: float
    generator: torch.Generator | None
    out: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


class TinyChatModel:
    """Tokenizer, template and target; `generate` batches whatever jobs are active."""

    def __init__(self, target_dir: str | Path, max_batch: int = 16):
        self.tokenizer = load_tokenizer(target_dir)
        self.model = TargetModel.from_pretrained(target_dir, "cpu", dtype=torch.float32, with_head=True)
        self.vocab_size = self.model.config.vocab_size
        self.stop_ids = {i for i in (self.tokenizer.eos_token_id, self.tokenizer.pad_token_id) if i is not None}
        self.max_batch = max_batch
        self._queue: queue.Queue[_Job] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="tiny-server-generate")
        self._thread.start()

    def submit(self, job: _Job) -> _Job:
        self._queue.put(job)
        return job

    def _loop(self) -> None:
        active: list[_Job] = []
        while True:
            if not active:
                active.append(self._queue.get())
            while len(active) < self.max_batch:
                try:
                    active.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._step(active)
            except Exception as e:  # a model error answers every active request with it
                logger.exception("generation failed")
                for job in active:
                    job.error = f"{type(e).__name__}: {e}"
                    job.done.set()
                active = []
                continue
            still = []
            for job in active:
                if self._finished(job):
                    job.done.set()
                else:
                    still.append(job)
            active = still

    def _finished(self, job: _Job) -> bool:
        if job.out and job.out[-1] in self.stop_ids:
            job.finish_reason = "stop"
            return True
        return len(job.out) >= job.max_tokens

    def _step(self, jobs: list[_Job]) -> None:
        seqs = [job.prompt + job.out for job in jobs]
        lengths = [len(s) for s in seqs]
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
        ids = torch.tensor(np.concatenate(seqs), dtype=torch.long)
        pos = torch.cat([torch.arange(n) for n in lengths])
        greedy = all(job.temperature == 0 for job in jobs)
        _, top_ids, top_logprobs = self.model.topk_next_tokens(ids, pos, cu, [0], k=1 if greedy else self.vocab_size)
        last = (cu[1:] - 1).long()
        for j, job in enumerate(jobs):
            if job.temperature == 0:
                token = int(top_ids[last[j], 0])
            else:
                probs = torch.softmax(top_logprobs[last[j]].double() / job.temperature, dim=-1)
                token = int(top_ids[last[j], torch.multinomial(probs, 1, generator=job.generator)])
            job.out.append(token)


def _completion(model: TinyChatModel, body: dict, thinking: bool, job: _Job, request_id: str) -> dict:
    tok = model.tokenizer
    text = tok.decode(job.out, skip_special_tokens=True)
    reasoning = None
    if thinking:  # the prompt opened <think>: the model's text up to </think> is its reasoning
        reasoning, _, text = text.partition("</think>") if "</think>" in text else (text, "", "")
        reasoning, text = reasoning.strip(), text.strip()
    message = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model", "tiny"),
        "choices": [{"index": 0, "message": message, "finish_reason": job.finish_reason}],
        "usage": {
            "prompt_tokens": len(job.prompt),
            "completion_tokens": len(job.out),
            "total_tokens": len(job.prompt) + len(job.out),
        },
    }


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a hanging handler (--hang-after) must not keep the process alive
    request_queue_size = 256  # the default backlog of 5 resets connections under --concurrency 64


def make_server(
    model: TinyChatModel, port: int = 0, faults: Faults | None = None, model_name: str = "tiny"
) -> ThreadingHTTPServer:
    """An HTTP server bound to 127.0.0.1:port (0 = a free port); call serve_forever() to run it."""
    faults = faults or Faults()
    counter = {"n": 0}
    lock = threading.Lock()
    closing = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *args):  # quiet: tests and the demo read the client's output
            logger.debug(fmt, *args)

        def _send(self, status: int, obj: dict) -> None:
            raw = json.dumps(obj).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout): fine
                pass

        def _error(self, status: int, message: str) -> None:
            self._send(
                status,
                {
                    "error": {
                        "message": message,
                        "type": "invalid_request_error" if status < 500 else "server_error",
                        "code": status,
                    }
                },
            )

        def do_GET(self):
            if self.path.rstrip("/") in ("/health", ""):
                self._send(200, {"status": "ok"})
            elif self.path.rstrip("/") == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "tiny"}]})
            else:
                self._error(404, f"no route {self.path}")

        def do_POST(self):
            if self.path.rstrip("/") != "/v1/chat/completions":
                return self._error(404, f"no route {self.path}")
            with lock:
                counter["n"] += 1
                number = counter["n"]
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            except (ValueError, json.JSONDecodeError) as e:
                return self._error(400, f"request body is not JSON: {e}")
            if faults.hang_after is not None and number > faults.hang_after:
                closing.wait()
                return
            if number in faults.delay_s and closing.wait(faults.delay_s[number]):
                return  # the server stopped meanwhile: no generation while the process exits
            if number in faults.fail_requests:
                return self._error(500, f"injected failure of request {number}")
            if body.get("stream"):
                return self._error(400, "streaming is not supported by the tiny server")
            if body.get("model") not in (None, model_name):
                return self._error(404, f"model {body.get('model')!r} does not exist; this server has {model_name!r}")
            kwargs = body.get("chat_template_kwargs") or {}
            thinking = kwargs.get("enable_thinking", True) is not False
            try:
                prompt = model.tokenizer.apply_chat_template(
                    body["messages"],
                    tools=body.get("tools"),
                    add_generation_prompt=True,
                    enable_thinking=thinking,
                    tokenize=False,
                )
                prompt_ids = model.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            except Exception as e:  # the template's raise_exception, missing messages, ...
                return self._error(400, f"cannot render the messages: {type(e).__name__}: {e}")
            temperature = float(body.get("temperature", 1.0) or 0.0)
            max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 256)
            if max_tokens < 1:
                return self._error(400, f"max_tokens must be at least 1, got {max_tokens}")
            gen = None
            if temperature > 0:
                gen = torch.Generator().manual_seed(int(body.get("seed") or 0))
            job = model.submit(_Job(prompt_ids, max_tokens, temperature, gen))
            job.done.wait()
            if job.error:
                return self._error(500, job.error)
            self._send(200, _completion(model, body, thinking, job, f"chatcmpl-{number}"))

    server = _Server(("127.0.0.1", port), Handler)
    original_close = server.server_close

    def server_close():
        closing.set()
        original_close()

    server.server_close = server_close
    return server


def _int_set(text: str) -> frozenset[int]:
    return frozenset(int(v) for v in text.replace(",", " ").split()) if text else frozenset()


def _delays(text: str) -> dict[int, float]:
    out = {}
    for item in text.replace(",", " ").split():
        number, _, seconds = item.partition(":")
        out[int(number)] = float(seconds)
    return out


@click.command(context_settings=CONTEXT_SETTINGS)
@click.option(
    "--target",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="Tiny target checkpoint (with tokenizer and chat template).",
)
@click.option("--port", default=0, show_default=True, help="Port on 127.0.0.1; 0 = a free one (printed).")
@click.option(
    "--port-file", type=click.Path(dir_okay=False), default=None, help="Also write the port number to this file."
)
@click.option("--model-name", default="tiny", show_default=True, help="The model name clients must send.")
@click.option("--max-batch", default=16, show_default=True, help="Most sequences generated together.")
@click.option(
    "--fail-requests", default="", help="Answer these chat requests (numbered from 1) with HTTP 500, e.g. 3,7."
)
@click.option("--delay-requests", default="", help="N:SECONDS pairs: wait before serving request N, e.g. 2:5.")
@click.option("--hang-after", type=int, default=None, help="Never answer chat requests after the Nth.")
@click.option("--threads", default=1, show_default=True, help="torch CPU threads for the forward.")
def main(
    target: str,
    port: int,
    port_file: str | None,
    model_name: str,
    max_batch: int,
    fail_requests: str,
    delay_requests: str,
    hang_after: int | None,
    threads: int,
) -> None:
    """Serve the tiny target as an OpenAI-compatible chat endpoint on 127.0.0.1 (tests, demo)."""
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(threads)
    server = make_server(
        TinyChatModel(target, max_batch=max_batch),
        port,
        Faults(_int_set(fail_requests), _delays(delay_requests), hang_after),
        model_name,
    )
    bound = server.server_address[1]
    if port_file:
        Path(port_file).write_text(f"{bound}\n")
    click.echo(f"serving {target} as {model_name!r} on http://127.0.0.1:{bound}/v1", err=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
