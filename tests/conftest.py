import sys
from pathlib import Path

# The helpers (distributed.py, equivalence.py) are imported by name, also inside spawned ranks.
sys.path.insert(0, str(Path(__file__).parent))
