"""Writes the schemas the chart tests validate custom resources against (beside this file), from
the projects' own CustomResourceDefinition files: the storage version's openAPIV3Schema, with
the `description` texts dropped (they are most of each file and no check reads them).

    python tests/chart/crds/vendor.py PATH/TO/<group>_<plural>.yaml ...

README.md beside this file lists the files and releases vendored.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml


def without_descriptions(node):
    """The schema without its `description` keywords (a property named "description" stays)."""
    if isinstance(node, list):
        return [without_descriptions(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "description" and isinstance(value, str):
            continue
        if key == "properties":
            out[key] = {name: without_descriptions(s) for name, s in value.items()}
        else:
            out[key] = without_descriptions(value)
    return out


def vendor(crd_file: Path, out_dir: Path) -> Path:
    crd = yaml.safe_load(crd_file.read_text())
    spec = crd["spec"]
    (version,) = [v for v in spec["versions"] if v.get("storage")]
    schema = {"group": spec["group"], "kind": spec["names"]["kind"], "version": version["name"],
              "openAPIV3Schema": without_descriptions(version["schema"]["openAPIV3Schema"])}
    out = out_dir / f"{spec['names']['kind'].lower()}-{spec['group']}-{version['name']}.json"
    out.write_text(json.dumps(schema, indent=1) + "\n")
    return out


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(vendor(Path(path), Path(__file__).resolve().parent))
