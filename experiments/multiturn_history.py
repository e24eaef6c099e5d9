"""
Context management on the guessing game: multiturn.py --layout steps with --history full, 2, 1, 0
and summary (each turn's prompt holds every turn so far, the last k, or none and the range still
possible), from the same SFT policy (sft.py --task guess, built if missing), each seed's runs at
the script's defaults: the same steps, games and episodes a step.

Prints the table of experiments/multiturn_credit.py (whose loop this shares) and writes
results/multiturn/history.json and results/multiturn/history.png.

Run:
    python experiments/multiturn_history.py --seeds 0 1 2 --jobs 2
    python experiments/multiturn_history.py --seeds 0 1 2 --table_only    # from the runs there
"""
from multiturn_credit import sweep

HISTORIES = {h: ["--layout", "steps", "--history", h] for h in ("full", "2", "1", "0", "summary")}

if __name__ == "__main__":
    sweep(HISTORIES, "--history", "history", "multiturn.py --history, same start")
