"""Where the checkpoint test helpers live (child processes put it on PYTHONPATH)."""

from pathlib import Path

HERE = Path(__file__).parent
