"""Every script as a newcomer starts it: `python X.py --help` in a new process, all at once. (Each
script's end-to-end test makes its first run from the command line too: run_script(..., fresh=True);
the rest of the suite runs scripts in the test's own process, tests/inprocess.py.)"""
import os

import pytest

from conftest import ROOT, run_scripts

SCRIPTS = sorted(f for f in os.listdir(ROOT) if f.endswith(".py")
                 and 'if __name__ == "__main__":' in open(os.path.join(ROOT, f)).read())


@pytest.mark.slow
def test_every_script_explains_itself_from_the_command_line():
    assert len(SCRIPTS) >= 20, SCRIPTS
    for script, p in zip(SCRIPTS, run_scripts([(s, ["--help"]) for s in SCRIPTS], fresh=True)):
        assert p.returncode == 0 and p.stderr == "", (script, p.stderr)
        assert p.stdout.startswith(f"usage: {script}"), (script, p.stdout[:200])
