"""Python started in the folder that holds a clone named ``fedsplit`` imports the real fedsplit.

``git clone .../fedsplit`` makes a folder ``fedsplit/`` without an ``__init__.py``; Python run
beside it (``python -c "from fedsplit.client.models import ..."`` in the clone's parent folder)
finds that folder before the editable install's import hook and makes a namespace package of it,
which has none of ``fedsplit/__init__.py``. Each package then loads the clone's
``fedsplit/__init__.py`` into it (see that file): the documented snippets work from any folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = (
    "import json, sys\n"
    "from fedsplit.client.models import build_model\n"
    "import fedsplit, fedsplit.protocol\n"
    "from fedsplit.protocol.errors import ConfigError\n"
    "from fedsplit.protocol import ConfigError as again\n"
    "model = build_model('mlp/classification/4/2/8', seed=0)\n"
    "print(json.dumps({'file': fedsplit.__file__, 'packages': list(fedsplit.PACKAGES),\n"
    "                  'one_class': ConfigError is again,\n"
    "                  'params': sum(p.numel() for p in model.parameters()),\n"
    "                  'bare': sorted(m for m in sys.modules if m.split('.')[0] in fedsplit.PACKAGES)}))\n"
)


def test_python_beside_a_clone_named_fedsplit_imports_fedsplit(tmp_path: Path) -> None:
    """From the clone's parent folder (here a link named ``fedsplit`` to this checkout) the
    documented import works, loads fedsplit/__init__.py and no module twice."""
    (tmp_path / "fedsplit").symlink_to(ROOT, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(out["file"]).resolve() == (ROOT / "fedsplit" / "__init__.py").resolve()
    assert out["packages"] == ["protocol", "aggregation", "server", "client", "orchestration", "cli"]
    assert out["one_class"] is True
    assert out["params"] == 4 * 8 + 8 + 8 * 2 + 2
    assert out["bare"] == [], out["bare"]
