"""Write a synthetic JSONL request trace.

    python -m bench.workloads generated-shared-prefix --seed 0 --output gsp.jsonl \\
        --num-groups 64 --prompts-per-group 16 --system-prompt-len 2048 --question-len 128
    python -m bench.workloads multi-turn --seed 0 --output mt.jsonl --num-clients 16 --num-rounds 4
    python -m bench.workloads few-shot --seed 0 --output fs.jsonl --text

See :mod:`radixkv.sim.workloads` for the request fields. The same arguments give the same file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from radixkv.sim import workloads


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--output", required=True, help="JSONL file to write")
    p.add_argument("--text", action="store_true", help='write "text" instead of "input_ids"')
    p.add_argument("--vocab-min", type=int, default=workloads.DEFAULT_VOCAB_RANGE[0])
    p.add_argument("--vocab-max", type=int, default=workloads.DEFAULT_VOCAB_RANGE[1])
    p.add_argument(
        "--request-rate", type=float, default=None, help="Poisson arrivals (req/s); else all at 0"
    )
    p.add_argument("--num-salts", type=int, default=0, help="tag requests with N tenant salts")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.workloads", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="kind", required=True, metavar="KIND")

    p = sub.add_parser("generated-shared-prefix", help="groups of prompts sharing a system prompt")
    _common(p)
    p.add_argument("--num-groups", type=int, default=64)
    p.add_argument("--prompts-per-group", type=int, default=16)
    p.add_argument("--system-prompt-len", type=int, default=2048)
    p.add_argument("--question-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)

    p = sub.add_parser("multi-turn", help="conversations whose prompts grow round by round")
    _common(p)
    p.add_argument("--num-clients", type=int, default=16)
    p.add_argument("--num-rounds", type=int, default=4)
    p.add_argument("--turn-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--shared-system-prompt-len", type=int, default=0)

    p = sub.add_parser("few-shot", help="fixed translation examples + a new sentence")
    _common(p)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--num-examples", type=int, default=8)
    p.add_argument("--example-len", type=int, default=32)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    common = dict(
        seed=args.seed,
        text=args.text,
        vocab_range=(args.vocab_min, args.vocab_max),
        request_rate=args.request_rate,
        num_salts=args.num_salts,
    )
    if args.kind == "generated-shared-prefix":
        reqs = workloads.generated_shared_prefix(
            args.num_groups,
            args.prompts_per_group,
            args.system_prompt_len,
            args.question_len,
            args.output_len,
            **common,
        )
    elif args.kind == "multi-turn":
        reqs = workloads.multi_turn(
            args.num_clients,
            args.num_rounds,
            args.turn_len,
            args.output_len,
            args.shared_system_prompt_len,
            **common,
        )
    else:
        reqs = workloads.few_shot(
            args.num_requests,
            args.num_examples,
            args.example_len,
            args.question_len,
            args.output_len,
            **common,
        )
    n = workloads.write_jsonl(reqs, args.output)
    print(f"wrote {n} requests to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
