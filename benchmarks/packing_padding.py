"""Whole-document packing's padding: windows and padding share of one epoch, `--packing whole` against `stream`.

`PackedStream` (distill/data.py) over a corpus's training documents with the fixture's tokenizer, at each window
length; `stream` concatenates and cuts (no padding), `whole` keeps a document that fits a window inside one
(first-fit over WHOLE_OPEN open windows; the rest is masked padding).

    python benchmarks/packing_padding.py --data py:transformers --seq-lens 256,2048 --json /tmp/padding.json
"""

from __future__ import annotations

from _common import FIXTURE, parser, stamp, write_json


def epoch(data: str, seq_len: int, packing: str) -> dict:
    from transformers import AutoTokenizer

    from recycle.distill.data import PackedStream
    from recycle.texts import data_source

    src = data_source(data)
    stream = PackedStream(src.train, AutoTokenizer.from_pretrained(FIXTURE), seq_len, packing=packing)
    windows = sum(1 for _ in stream._epoch(0))
    return {"windows": windows, "padding_share": round(stream.padding_share, 5), "documents": len(stream.texts())}


def main() -> None:
    ap = parser(__doc__, json=True)
    ap.add_argument("--data", default="py:transformers")
    ap.add_argument("--seq-lens", default="256,2048")
    a = ap.parse_args()
    rows = []
    for n in map(int, a.seq_lens.split(",")):
        for packing in ("whole", "stream"):
            r = {"seq_len": n, "packing": packing, **epoch(a.data, n, packing)}
            rows.append(r)
            print(f"seq-len {n:5d} {packing:6s}: {r['windows']:,} windows, padding {r['padding_share']:.2%} "
                  f"({r['documents']:,} documents)", flush=True)
    if a.json:
        write_json(a.json, {**stamp(), "data": a.data, "rows": rows})


if __name__ == "__main__":
    main()
