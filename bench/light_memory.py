"""Resident memory of a light node's parts: its imports, then each model's parsed tokenizer.

Run: ``python bench/light_memory.py [FOLDER ...]``. Each FOLDER holds a model's tokenizer files
(``inference/tokfiles.py``): a light node's ``<home>/tokenizers/<model>``, or the folder a
serving node converted a model into (``~/.cache/p2pnode/models/gguf-<sha256>`` for a GGUF
file); none given: the default model's. Prints, and writes to ``bench/results/light_memory.json``,
VmRSS after glibc ``malloc_trim`` and the peak so far: after the imports of a light node (the
API, the overlay, the swarm's routers), then after parsing each folder's tokenizer as a light
node does (one malloc heap for all threads, ``share_one_heap``, set before any thread starts,
as ``bootstrap/node.py`` does; ``tokenizer_model`` in a worker thread, ``overlay/serve/swarm.py``).
A few seconds; the figures vary by a few MB from run to run (hash seeds: where the maps land).
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import trio


def _rss_mb() -> tuple[float, float]:
    from p2pnode.inference.models import release_freed_memory

    release_freed_memory()
    with open("/proc/self/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss_kb / 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def _measure(folders: list[Path]) -> list[dict]:
    import p2pnode.bootstrap.api
    import p2pnode.bootstrap.node
    import p2pnode.overlay.net.node
    import p2pnode.overlay.serve.swarm  # noqa: F401 - what a light node imports
    from p2pnode.inference.models import tokenizer_model
    from p2pnode.inference.textfront import TextFront

    rows = [{"holds": "imports", **dict(zip(("rss_mb", "peak_mb"), _rss_mb(), strict=True))}]
    kept = []
    for folder in folders:
        light = await trio.to_thread.run_sync(tokenizer_model, folder, folder.name, folder.name)
        kept.append(TextFront(light))
        kept[-1].decode(kept[-1].encode("The capital of France is"))
        rss, peak = _rss_mb()
        rows.append({"holds": f"+ {folder.name}", "rss_mb": rss, "peak_mb": peak})
    assert "torch" not in sys.modules and "transformers" not in sys.modules
    return rows


def main() -> None:
    if len(sys.argv) > 1:
        folders = [Path(a) for a in sys.argv[1:]]
    else:
        from p2pnode.inference.models import DEFAULT_MODEL_NAME, cache_dir

        folders = [cache_dir() / "models" / DEFAULT_MODEL_NAME]
    from p2pnode.inference.models import share_one_heap

    share_one_heap()  # as a light node does before its first thread (bootstrap/node.py)
    rows = trio.run(_measure, folders)
    for row in rows:
        print(f"{row['holds']:50s} {row['rss_mb']:6.0f} MB  (peak {row['peak_mb']:.0f} MB)")
    out = Path(__file__).parent / "results" / "light_memory.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
