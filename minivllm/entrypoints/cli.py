from __future__ import annotations

import argparse
import os

from .api_server import build_app
from .async_llm import AsyncLLM

ENGINE_FLAGS = (("--device", str, "auto"), ("--dtype", str, "auto"), ("--max-model-len", int, None),
                ("--max-num-seqs", int, None), ("--max-num-batched-tokens", int, None),
                ("--gpu-memory-utilization", float, None), ("--tensor-parallel-size", int, None),
                ("--block-size", int, None), ("--seed", int, None), ("--generation-config", str, None))


def parse_serve_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="minivllm serve", description="An OpenAI-compatible server over one model.")
    ap.add_argument("model", help="a checkpoint folder or a Hugging Face id")
    ap.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=os.environ.get("MINIVLLM_API_KEY"),
                    help="require 'Authorization: Bearer <key>' on /v1 routes (default: $MINIVLLM_API_KEY)")
    ap.add_argument("--served-model-name", default=None, help="the model's name in the API (default: MODEL)")
    ap.add_argument("--max-waiting-requests", type=int, default=1024, help="beyond this many waiting: 503")
    ap.add_argument("--max-request-bytes", type=int, default=1 << 20, help="larger bodies: 413")
    ap.add_argument("--log-level", default="info")
    for flag, kind, default in ENGINE_FLAGS:
        ap.add_argument(flag, type=kind, default=default)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--no-prefix-caching", action="store_true")
    return ap.parse_args(argv)


def engine_kwargs(args: argparse.Namespace) -> dict:
    "The engine flags given (the ones left out keep the engine's defaults)."
    kwargs = {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_")) for flag, _, _ in ENGINE_FLAGS}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    return kwargs | {"enforce_eager": args.enforce_eager, "enable_prefix_caching": not args.no_prefix_caching}


def serve(argv: list[str] | None = None) -> int:
    "`minivllm serve MODEL ...`: run the server until SIGINT or SIGTERM, then stop the engine."
    import uvicorn
    args = parse_serve_args(argv)
    llm = AsyncLLM(args.model, **engine_kwargs(args))
    try:
        app = build_app(llm, args.served_model_name or args.model, args.api_key, args.max_waiting_requests,
                        args.max_request_bytes)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=5)
        uvicorn.Server(config).run()
    finally:
        llm.shutdown()
    return 0
