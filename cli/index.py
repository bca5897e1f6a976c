"""``kvgate index``: inspect a running gateway's KV index over its admin listener."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gateway",
        default=os.environ.get("KVGATE_ADMIN_URL", "http://127.0.0.1:8001"),
        help="the gateway's admin listener (default $KVGATE_ADMIN_URL or http://127.0.0.1:8001)",
    )
    parser.add_argument(
        "--admin-key",
        default=os.environ.get("KVGATE_ADMIN_KEY"),
        help="an admin key (admin.api_keys; default $KVGATE_ADMIN_KEY); client keys do not work",
    )
    parser.add_argument("--json", action="store_true", help="print the raw JSON answer")
    sub = parser.add_subparsers(dest="index_command", required=True)
    sub.add_parser("stats", help="index size, backend and event subscribers")
    sub.add_parser("pods", help="blocks held per pod and tier")
    look = sub.add_parser("lookup", help="which pods/tiers hold how many blocks of a prompt")
    look.add_argument("--model", required=True)
    src = look.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="a completion prompt")
    src.add_argument("--messages", help="chat messages as a JSON array")
    src.add_argument("--messages-file", type=Path, help="file holding the JSON messages array")
    look.add_argument("--cache-salt")


def run(args: argparse.Namespace) -> int:
    console = Console()
    headers = {"authorization": f"Bearer {args.admin_key}"} if args.admin_key else {}
    base = args.gateway.rstrip("/")
    try:
        if args.index_command == "lookup":
            body: dict[str, Any] = {"model": args.model}
            if args.prompt is not None:
                body["prompt"] = args.prompt
            else:
                text = args.messages_file.read_text() if args.messages_file else args.messages
                body["messages"] = json.loads(text)
            if args.cache_salt:
                body["cache_salt"] = args.cache_salt
            r = httpx.post(f"{base}/admin/index/lookup", json=body, headers=headers, timeout=30)
        else:
            r = httpx.get(f"{base}/admin/index/stats", headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        console.print(f"[red]cannot reach {base}: {exc}")
        return 2
    if r.status_code != 200:
        console.print(f"[red]{r.status_code}: {r.text}")
        return 1
    data = r.json()
    if args.json:
        json.dump(data, sys.stdout, indent=2)
        print()
    elif args.index_command == "lookup":
        _print_lookup(console, data)
    elif args.index_command == "pods":
        _print_pods(console, data)
    else:
        _print_stats(console, data)
    return 0


def _print_lookup(console: Console, d: dict[str, Any]) -> None:
    console.print(
        f"model {d['model']}: {d['prompt_tokens']} tokens, {d['full_blocks']} full blocks "
        f"of {d['block_size']}; fleet L2 prefix: {d['l2_blocks']} blocks"
    )
    table = Table("pod", "L0 prefix blocks", "L0+L1 prefix blocks", "of")
    for pod, p in d["pods"].items():
        table.add_row(pod, str(p["l0_blocks"]), str(p["l0_l1_blocks"]), str(d["full_blocks"]))
    console.print(table)


def _print_pods(console: Console, d: dict[str, Any]) -> None:
    tiers = sorted({t for counts in d["per_pod"].values() for t in counts})
    table = Table("pod", *tiers)
    for pod, counts in sorted(d["per_pod"].items()):
        table.add_row(pod, *(str(counts.get(t, 0)) for t in tiers))
    console.print(table)


def _print_stats(console: Console, d: dict[str, Any]) -> None:
    console.print(
        f"backend {d['backend']}: {d['keys']} keys of {d['capacity']} capacity, "
        f"{d['l2_keys']} in L2"
    )
    _print_pods(console, d)
    for pod, ranks in d.get("subscribers", {}).items():
        console.print(f"events {pod}: {json.dumps(ranks)}")
