"""Where a kernel's warps wait, by region of its machine code, from ncu's source page:

    ncu --kernel-name regex:NAME --launch-count 1 --section WarpStateStats --section SourceCounters -o REP python3 ...
    ncu --import REP.ncu-rep --page source --csv --print-source sass > SOURCE.csv
    python benchmarks/micro/ncu_stall_regions.py SOURCE.csv --chunks 60            # the code in chunks, to pick bounds
    python benchmarks/micro/ncu_stall_regions.py SOURCE.csv setup:0 mainloop:120 epilogue:780 producer:1920

A region runs from its first instruction (index into the SASS listing) to the next region's. For each:
warp-stall samples (share of all), the top stall reasons, warp instructions executed, and the most
sampled instructions.
"""
import collections
import csv
import sys


def load(path):
    rows = list(csv.reader(open(path)))
    header = next(r for r in rows if r and r[0] == "Address")
    data = [r for r in rows[rows.index(header) + 1:] if len(r) == len(header)]
    col = {name: i for i, name in enumerate(header)}
    stalls = [i for i, name in enumerate(header) if name.startswith("stall_") and "Not Issued" not in name]
    return header, data, col, stalls


def opcode(text):
    words = text.strip().split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def main(argv):
    header, data, col, stalls = load(argv[1])
    samples = [int(r[col["Warp Stall Sampling (All Samples)"]]) for r in data]
    executed = [int(r[col["Instructions Executed"]]) for r in data]
    total = sum(samples)
    print(f"{argv[1]}: {len(data)} instructions, {total} samples")
    if len(argv) > 2 and argv[2] == "--chunks":
        n = int(argv[3])
        for a in range(0, len(data), n):
            ops = collections.Counter(opcode(r[1]) for r in data[a:a + n])
            print(f"{a:5d} {sum(samples[a:a + n]):7d} {max(executed[a:a + n]):9d}  {dict(ops.most_common(6))}")
        return
    bounds = [(name, int(start)) for name, start in (arg.split(":") for arg in argv[2:])]
    for (name, a), (_, b) in zip(bounds, bounds[1:] + [("end", len(data))]):
        region = sum(samples[a:b])
        reasons = collections.Counter({header[i][6:]: sum(int(r[i]) for r in data[a:b]) for i in stalls})
        top = ", ".join(f"{k} {100 * v / max(region, 1):.0f}%" for k, v in reasons.most_common(4))
        print(f"{name} [{a}, {b}): {region} samples ({100 * region / total:.1f}%); {top}; "
              f"{sum(executed[a:b])} warp instructions")
        for i in sorted(range(a, b), key=lambda i: -samples[i])[:3]:
            print(f"    {samples[i]:6d}  {data[i][1].strip()[:72]}")


if __name__ == "__main__":
    main(sys.argv)
