import sys
from pathlib import Path

# viz_frames_fixture.py lives next to the tests; importable whatever pytest's import mode.
sys.path.insert(0, str(Path(__file__).parent))
