"""Issue 41, round three: `make help`."""

import re
import subprocess

from eagle3ft.config import REPO_ROOT


def test_make_help_is_the_default_and_lists_every_target_with_a_line():
    makefile = (REPO_ROOT / "Makefile").read_text()
    phony = re.search(r"^\.PHONY: (.*)$", makefile, re.M).group(1).split()
    for argv in (["make", "-s", "help"], ["make", "-s"]):
        out = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=30, check=True).stdout
        listed = {line.split()[0]: line.split(None, 1)[1] for line in out.splitlines() if line.strip()}
        assert sorted(listed) == sorted(phony)
        assert all(len(text) > 5 for text in listed.values())
