#!/usr/bin/env python3
"""Prints the one-line summary of `make test`: "N passed, N failed".

Reads meson's testlog.json from each build directory given on the command
line (and pytest JUnit files passed with --junit). A doctest executable counts
as its test cases (from its "[doctest] test cases:" line); a test without such
a line (a script, a crashed binary) counts as one case, passed or failed by
its exit status. Exits non-zero if anything failed or nothing ran.
"""
import json
import os
import re
import sys
import xml.etree.ElementTree as ET

DOCTEST = re.compile(r"\[doctest\] test cases:\s*(\d+)\s*\|\s*(\d+) passed\s*\|\s*(\d+) failed")


def meson_counts(build_dir):
    path = os.path.join(build_dir, "meson-logs", "testlog.json")
    passed = failed = 0
    rows = []
    if not os.path.exists(path):
        return 0, 1, [(build_dir, "no test log (did the build fail?)", 0, 1)]
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            t = json.loads(line)
            ok = t.get("result") in ("OK", "EXPECTEDFAIL", "SKIP")
            m = DOCTEST.search(t.get("stdout") or "")
            if m and ok:
                p, fl = int(m.group(2)), int(m.group(3))
            elif m:
                p, fl = int(m.group(2)), max(1, int(m.group(3)))
            else:
                p, fl = (1, 0) if ok else (0, 1)
            passed += p
            failed += fl
            rows.append((build_dir, t.get("name"), p, fl))
    return passed, failed, rows


def junit_counts(path):
    if not os.path.exists(path):
        return 0, 1, [(path, "no JUnit report", 0, 1)]
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = failed = skipped = 0
    for s in suites:
        total += int(s.get("tests", 0))
        failed += int(s.get("failures", 0)) + int(s.get("errors", 0))
        skipped += int(s.get("skipped", 0))
    passed = total - failed - skipped
    name = ",".join(s.get("name") or "junit" for s in suites) or "junit"
    return passed, failed, [(path, name, passed, failed)]


def main(argv):
    total_p = total_f = 0
    rows = []
    args = iter(argv)
    for a in args:
        if a == "--junit":
            p, f, r = junit_counts(next(args))
        else:
            p, f, r = meson_counts(a)
        total_p += p
        total_f += f
        rows += r
    for where, name, p, f in rows:
        mark = "FAIL" if f else "ok"
        print(f"  {mark:4} {where}: {name}: {p} passed, {f} failed")
    if total_p + total_f == 0:
        total_f = 1
    print(f"{total_p} passed, {total_f} failed")
    return 1 if total_f else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
