"""Compare two runs' metrics.jsonl step by step on every value that is not a time or a speed: python3 compare.py RUN_A RUN_B."""
import json, sys
def rows(d):
    return [json.loads(l) for l in open(f"{d}/metrics.jsonl" if not d.endswith(".jsonl") else d)]
a, b = rows(sys.argv[1]), rows(sys.argv[2])
skip = ("time/",)
def keep(r): return {k: v for k, v in r.items() if not k.startswith(skip) and "tokens_per_s" not in k and not k.endswith("_s")}
diff = []
for i, (x, y) in enumerate(zip(a, b)):
    x, y = keep(x), keep(y)
    for k in sorted(set(x) | set(y)):
        if x.get(k) != y.get(k):
            diff.append((i + 1, k, x.get(k), y.get(k)))
print(len(a), len(b), "rows;", len(keep(a[0])), "keys compared in row 1;", len(diff), "differences")
for d in diff[:40]: print(d)
