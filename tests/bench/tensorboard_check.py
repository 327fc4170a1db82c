#!/usr/bin/env python3
"""Reads the event files rumor wrote under LOGDIR (--tensorboard LOGDIR)
with TensorBoard's own loader, EventAccumulator, and prints every run's
scalars: the independent reader of issue #17, item 1 (the C tests parse the
records with a parser of their own).

    python tensorboard_check.py LOGDIR [--all] [--expect RUN:TAG=VALUE ...]

For each run (a directory holding events.out.tfevents.* files) it prints
each tag's point count, first and last step and last value (--all: every
point). --expect checks that the last value of TAG in RUN is VALUE within
1e-6 relative (a float32's precision), e.g. train:eval/test_accuracy=0.6375.
Exits 1 when a run has no scalars, a file did not load whole, or an
expectation fails.
"""
import argparse
import os
import sys

from tensorboard.backend.event_processing import event_accumulator


def runs_of(logdir):
    for root, _dirs, files in sorted(os.walk(logdir)):
        if any(".tfevents." in f for f in files):
            yield os.path.relpath(root, logdir), root


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logdir")
    ap.add_argument("--all", action="store_true", help="print every point")
    ap.add_argument("--expect", action="append", default=[], metavar="RUN:TAG=VALUE")
    a = ap.parse_args()
    ok = True
    last = {}
    found = False
    for run, path in runs_of(a.logdir):
        found = True
        # size_guidance 0: keep every point (the default samples 1000 per tag).
        acc = event_accumulator.EventAccumulator(path, size_guidance={event_accumulator.SCALARS: 0})
        acc.Reload()
        tags = acc.Tags()["scalars"]
        print("run %s: %d scalar tags (%s)" % (run, len(tags), path))
        if not tags:
            print("  no scalars", file=sys.stderr)
            ok = False
        for tag in sorted(tags):
            ev = acc.Scalars(tag)
            last[(run, tag)] = ev[-1].value
            print("  %-34s %5d points  steps %d..%d  last %.9g" % (tag, len(ev), ev[0].step, ev[-1].step, ev[-1].value))
            if a.all:
                for e in ev:
                    print("      step %-8d %.9g" % (e.step, e.value))
    if not found:
        print("no event files under %s" % a.logdir, file=sys.stderr)
        ok = False
    for x in a.expect:
        key, _, value = x.rpartition("=")
        run, _, tag = key.partition(":")
        want = float(value)
        got = last.get((run, tag))
        if got is None or abs(got - want) > 1e-6 * max(1.0, abs(want)):
            print("expected %s:%s = %g, got %s" % (run, tag, want, got), file=sys.stderr)
            ok = False
        else:
            print("ok: %s:%s = %.9g" % (run, tag, got))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
