"""
DPO vs IPO on deterministic preferences: does the log-ratio margin keep growing, or settle?

h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)) (nats, the same in both files)

DPO minimises -log sigmoid(beta * h): its loss only reaches 0 as h -> infinity, and since every pair
in our data is won by its chosen side every time, nothing stops h (and the KL to the reference) from
growing. IPO minimises (h - 1/(2 tau))^2: h is pulled to 1/(2 tau) = 5 nats for tau = 0.1 and no
further. Like is compared with like: the table shows h in both, the quantity IPO regresses; the
implicit-reward margins the scripts also log are beta * h (DPO) and tau * h (IPO), and with beta =
tau = 0.1 they are h / 10.

This runs dpo.py and ipo.py one after the other with the same settings (longer than their defaults,
and a higher learning rate, so that the asymptote shows in a few minutes) into out/dpo/margin and
out/ipo/margin, then prints a markdown table from their metrics.jsonl. About 5 minutes per run on 2
otherwise idle CPU cores.

    python experiments/dpo_ipo_margin.py                 # run both, then print the table
    python experiments/dpo_ipo_margin.py --no_run        # only print the table from an earlier run
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--out", default="margin",
                        help="each run goes to out/<script>/<out> (e.g. out/dpo/margin)")
    parser.add_argument("--steps", type=int, default=200, help="optimisation steps of each run")
    parser.add_argument("--batch_size", type=int, default=16, help="pairs per step")
    parser.add_argument("--lr", type=float, default=1e-4, help="learning rate of both runs")
    parser.add_argument("--coef", type=float, default=0.1, help="DPO's beta and IPO's tau")
    parser.add_argument("--no_run", action="store_true",
                        help="do not train; print the table from the runs already in "
                             "out/dpo/<out> and out/ipo/<out>")
    return parser.parse_args(argv)


def main(args):
    outs = {name: os.path.join(ROOT, "out", name, args.out) for name in ("dpo", "ipo")}
    if not args.no_run:
        for name, coef in (("dpo", "--beta"), ("ipo", "--tau")):
            out = outs[name]
            os.makedirs(out, exist_ok=True)
            # reuse the shared pair cache (it checks its own key)
            for f in ("pairs_train.json", "pairs_eval.json"):
                if os.path.exists(os.path.join(ROOT, "out",
                                               f)) and not os.path.exists(os.path.join(out, f)):
                    shutil.copy(os.path.join(ROOT, "out", f), os.path.join(out, f))
            cmd = [sys.executable, f"{name}.py", "--steps", str(args.steps),
                   "--batch_size", str(args.batch_size), "--lr", str(args.lr), coef, str(args.coef),
                   "--log_every", "20", "--eval_every", str(args.steps), "--eval_n", "128",
                   "--out", out]
            print("$", " ".join(cmd[1:]), flush=True)
            subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    rows = {}
    for name in ("dpo", "ipo"):
        with open(os.path.join(outs[name], name, "metrics.jsonl")) as f:
            for line in f:
                r = json.loads(line)
                rows.setdefault(r["step"], {})[name] = r
    get = lambda r, k, fmt: format(r[k], fmt) if r is not None and k in r else ""
    print(f"\nlog-ratio margin h (nats; training batch), beta = tau = {args.coef}, "
          f"IPO target 1/(2 tau) = {1 / (2 * args.coef):.1f}; "
          f"lr {args.lr}, batch {args.batch_size}")
    print("| step | DPO h | DPO log-ratio chosen / rejected | IPO h | "
          "IPO log-ratio chosen / rejected | held-out greedy acc. DPO / IPO | "
          "KL to ref. (held-out chosen) DPO / IPO |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for step in sorted(rows):
        d, i = rows[step].get("dpo"), rows[step].get("ipo")
        cr = lambda r: (f"{get(r, 'chosen_logratio', '.1f')} / {get(r, 'rejected_logratio', '.1f')}"
                        if r and "loss" in r else "")
        pair = lambda k, fmt: (f"{get(d, k, fmt)} / {get(i, k, fmt)}"
                               if "eval_accuracy" in (d or i or {}) else "")
        print(f"| {step} | {get(d, 'logratio_margin', '.1f')} | {cr(d)} | "
              f"{get(i, 'logratio_margin', '.1f')} | {cr(i)} | {pair('eval_accuracy', '.3f')} | "
              f"{pair('eval_kl', '.1f')} |")


if __name__ == "__main__":
    main(parse_args())
