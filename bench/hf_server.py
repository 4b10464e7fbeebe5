"""A minimal OpenAI-compatible baseline server on plain transformers ``generate``.

    python -m bench.hf_server --model smollm2 --port 8100

One request at a time (an asyncio lock around ``generate``), no prefix cache (every request
prefills its whole prompt), streaming via a token streamer. ``/v1/completions`` takes a string or
a list of token ids; ``/v1/chat/completions`` applies the tokenizer's chat template. ``usage``
reports ``prompt_tokens_details.cached_tokens = 0``. ``ignore_eos`` forces ``max_tokens`` new
tokens (``min_new_tokens``). Only for benchmarks on 127.0.0.1: no auth, no validation beyond the
basics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

__all__ = ["create_app", "main"]


class _QueueStreamer:
    """A transformers streamer that forwards each new token id to an asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Any]) -> None:
        self.loop = loop
        self.queue = queue
        self.skipped_prompt = False

    def put(self, value: Any) -> None:
        """Called by ``generate`` with the prompt first, then with each new token."""
        if not self.skipped_prompt:
            self.skipped_prompt = True
            return
        for t in value.reshape(-1).tolist():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, int(t))

    def end(self) -> None:
        """Called once generation is over."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


def create_app(model: Any, tokenizer: Any, model_name: str) -> FastAPI:
    """The FastAPI app around an HF causal LM and its tokenizer."""
    import torch

    app = FastAPI(title="hf-baseline")
    lock = asyncio.Lock()
    eos = tokenizer.eos_token_id
    stats = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0}

    def generate_kwargs(body: dict[str, Any], n_prompt: int) -> dict[str, Any]:
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        temperature = float(body.get("temperature", 1.0) or 0.0)
        kw: dict[str, Any] = dict(
            max_new_tokens=max_tokens,
            do_sample=temperature > 0,
            pad_token_id=eos if eos is not None else 0,
        )
        if temperature > 0:
            kw["temperature"] = temperature
            kw["top_p"] = float(body.get("top_p", 1.0))
        if body.get("ignore_eos"):
            kw["min_new_tokens"] = max_tokens
        return kw

    def prompt_ids(body: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            ids = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(tokenizer.encode(prompt, add_special_tokens=False))
        return [int(t) for t in prompt]

    async def run(ids: list[int], kw: dict[str, Any]) -> AsyncIterator[int]:
        """Yield new token ids as ``generate`` makes them (holds the one-at-a-time lock)."""
        async with lock:
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue[Any] = asyncio.Queue()
            streamer = _QueueStreamer(loop, queue)
            errors: list[BaseException] = []

            def work() -> None:
                try:
                    with torch.inference_mode():
                        model.generate(
                            torch.tensor([ids]),
                            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            streamer=streamer,
                            **kw,
                        )
                except BaseException as e:  # surfaced to the client below
                    errors.append(e)
                    streamer.end()

            thread = threading.Thread(target=work, daemon=True)
            thread.start()
            while True:
                tok = await queue.get()
                if tok is None:
                    break
                yield tok
            await asyncio.to_thread(thread.join)
            if errors:
                raise RuntimeError(f"generate failed: {errors[0]}")

    def usage(n_prompt: int, n_out: int) -> dict[str, Any]:
        return {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": 0},
        }

    async def handle(request: Request, chat: bool) -> Any:
        body = await request.json()
        try:
            ids = prompt_ids(body, chat)
        except (KeyError, TypeError, ValueError) as e:
            return JSONResponse({"error": {"message": f"bad request: {e}"}}, status_code=400)
        if not ids:
            return JSONResponse({"error": {"message": "empty prompt"}}, status_code=400)
        kw = generate_kwargs(body, len(ids))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:16]
        obj = "chat.completion" if chat else "text_completion"
        created = int(time.time())
        stats["requests"] += 1
        stats["prompt_tokens"] += len(ids)

        def finish_reason(out: list[int]) -> str:
            return "length" if len(out) >= kw["max_new_tokens"] else "stop"

        if not body.get("stream"):
            out: list[int] = [t async for t in run(ids, kw)]
            stats["generated_tokens"] += len(out)
            text = tokenizer.decode(out, skip_special_tokens=True)
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(out)}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            return {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model_name,
                "choices": [choice],
                "usage": usage(len(ids), len(out)),
            }

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(text: str | None, finish: str | None, use: dict[str, Any] | None) -> str:
            choices: list[dict[str, Any]] = []
            if text is not None or finish is not None:
                c: dict[str, Any] = {"index": 0, "finish_reason": finish}
                if chat:
                    c["delta"] = {"content": text} if text is not None else {}
                else:
                    c["text"] = text or ""
                choices.append(c)
            payload: dict[str, Any] = {
                "id": rid,
                "object": obj + (".chunk" if chat else ""),
                "created": created,
                "model": model_name,
                "choices": choices,
            }
            if use is not None:
                payload["usage"] = use
            return f"data: {json.dumps(payload)}\n\n"

        async def events() -> AsyncIterator[str]:
            out: list[int] = []
            sent = ""
            try:
                async for tok in run(ids, kw):
                    out.append(tok)
                    text = tokenizer.decode(out, skip_special_tokens=True)
                    if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait
                        continue
                    delta, sent = text[len(sent) :], text
                    yield chunk(delta, None, None)
            except RuntimeError as e:
                yield f"data: {json.dumps({'error': {'message': str(e)}})}\n\n"
                return
            stats["generated_tokens"] += len(out)
            yield chunk("", finish_reason(out), None)
            if include_usage:
                yield chunk(None, None, usage(len(ids), len(out)))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handle(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model"}]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/cache/stats")
    async def cache_stats() -> dict[str, Any]:
        return {**stats, "cached_tokens_total": 0, "hit_rate": 0.0}

    return app


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.hf_server``: load the model and serve on 127.0.0.1."""
    p = argparse.ArgumentParser(prog="python -m bench.hf_server", description=__doc__)
    p.add_argument("--model", default="smollm2", help="smollm2, an HF dir or a .gguf path")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--served-model-name", default=None)
    args = p.parse_args(argv)

    import uvicorn

    from radixkv.model.loader import load_model

    loaded = load_model(args.model, dtype=args.dtype)
    app = create_app(loaded.hf_model, loaded.tokenizer, args.served_model_name or loaded.name)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
