"""Follow every request's text as detok's workers commit it: the reader beside
`engine_publish.py` (a chat UI's or a monitor's loop), through `workers.io.follow`.

Each line is one request's new text as it is committed (`request-id | text`, newlines shown as
`⏎`); at a completion, its status and why it ended. With `--count N` it stops after N
completions; with `--json FILE` it also writes each completed request's whole text as the reader
assembled it, one JSON object a line (`detok follow REQUEST_ID` is the same for one request).

    python examples/follow_requests.py --count 16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from workers.io.follow import follow
from workers.kafka.topic_names import TopicNames


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap-servers", default="127.0.0.1:19092")
    parser.add_argument("--deltas-topic", default=TopicNames().deltas)
    parser.add_argument("--completions-topic", default=TopicNames().completions)
    parser.add_argument("--count", type=int, help="stop after this many completions")
    parser.add_argument("--idle-timeout", type=float, help="stop after this long without a record")
    parser.add_argument("--json", type=Path, help="write each completed request's text here")
    args = parser.parse_args()
    names = TopicNames(deltas=args.deltas_topic, completions=args.completions_topic)
    texts: dict[str, str] = {}
    completed = []
    for update in follow(args.bootstrap_servers, names, idle_timeout_s=args.idle_timeout):
        texts[update.request_id] = texts.get(update.request_id, "") + update.text
        if update.text:
            print(f"{update.request_id} | {update.text.replace(chr(10), '⏎')}", flush=True)
        completion = update.completion
        if completion is None:
            continue
        why = completion.stop_reason and f"stop string {completion.stop_reason!r}"
        print(f"{update.request_id} = {completion.status} "
              f"({why or completion.finish_reason or completion.error})", flush=True)  # fmt: skip
        completed.append({"request_id": update.request_id, "text": texts[update.request_id],
                          "status": completion.status})  # fmt: skip
        if args.count is not None and len(completed) >= args.count:
            break
    if args.json:
        args.json.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in completed))
    print(f"followed {len(completed)} requests to their completion", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
