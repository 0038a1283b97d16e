"""Write a job's index: every shard its done markers list, with totals.

    python tools/merge.py gs://B/jobs/J             # writes gs://B/jobs/J/index.json
    python tools/merge.py /tmp/queue --out -        # prints it

The totals line counts tasks, shards, samples, stored tokens (`tokens`) and bytes, plus the records' counters: a
sampled job's (token_sample, drop_first) `processed_tokens` beside its `stored_tokens`, and `skipped_rows`.
"""

import argparse
import json
import sys
from pathlib import Path

import objectstore
from fleet import gapi, jobindex


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("queue", help="queue prefix: gs://bucket/prefix or a local directory")
    parser.add_argument("--out", help=f"local file to write, or - for stdout (default: {jobindex.INDEX_NAME} under the queue)")
    args = parser.parse_args()
    gapi.setup_logging()
    store = objectstore.open_store(args.queue)
    try:
        index = jobindex.build_index(store)
    except (jobindex.JobIndexError, objectstore.StoreError) as err:
        sys.exit(f"error: {err}")
    if args.out == "-":
        json.dump(index, sys.stdout, indent=2, sort_keys=True)
        print()
    elif args.out:
        Path(args.out).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    else:
        jobindex.write_index(store, index)
    totals = index["totals"]
    print(" ".join(f"{k}={v}" for k, v in totals.items()), file=sys.stderr)


if __name__ == "__main__":
    main()
