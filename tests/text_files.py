"""Text files to prepare into token data: shared by the ``data prepare`` tests."""
from __future__ import annotations


def write_texts(tmp_path, contents: list[bytes], prefix: str = "t") -> list[str]:
    """Files ``{prefix}{i}.txt`` in ``tmp_path`` holding ``contents[i]``; their paths in order."""
    paths = []
    for i, data in enumerate(contents):
        p = tmp_path / f"{prefix}{i}.txt"
        p.write_bytes(data)
        paths.append(str(p))
    return paths
