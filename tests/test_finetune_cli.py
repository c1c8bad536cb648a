"""mtp/finetune_cli.py, finetune_hf.py's command line. Its checks of every bad flag, path
and output folder run in test_cli.py, beside the other scripts'; here, what --help says."""
import re
from pathlib import Path

import pytest

from mtp.finetune_cli import build_parser

REPO = Path(__file__).resolve().parents[1]


def test_help_names_only_files_the_repository_has(capsys):
    """Every --help names only scripts the repository holds, and no placeholder."""
    for command in ([], ["train"], ["eval"], ["analyze"], ["data"], ["export"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*command, "--help"])
        text = capsys.readouterr().out
        assert "usage: finetune_hf.py" in text
        assert "METHOD" not in text
        names = re.findall(r"[\w/]+\.py\b", text)
        assert all((REPO / f).is_file() for f in names)

