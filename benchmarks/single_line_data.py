"""A one-line text file of a given size for the single-line data benchmark (BENCHMARKS.md, issue 45): transformers' own
source, newlines turned to spaces, repeated.

    python benchmarks/single_line_data.py OUT BYTES
"""

import pathlib

import transformers

from _common import parser

ap = parser(__doc__)
ap.add_argument("out", type=pathlib.Path)
ap.add_argument("bytes", type=int, help="write at least this many characters")
args = ap.parse_args()
root = pathlib.Path(transformers.__file__).parent
text = " ".join(p.read_text(encoding="utf-8", errors="replace").replace("\n", " ") for p in sorted(root.rglob("*.py"))[:400])
out, target = args.out, args.bytes
with out.open("w", encoding="utf-8") as f:
    n = 0
    while n < target:
        f.write(text + " ")
        n += len(text) + 1
print(out.stat().st_size)
