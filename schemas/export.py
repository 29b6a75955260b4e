"""Export the JSON Schema of every wire model to `schemas/json/`.

Run `python -m schemas.export` after changing a model; a test fails while the files are stale, so
consumers in other languages always find the schema that the code enforces.
"""

from __future__ import annotations

import json
from pathlib import Path

from schemas.events import INPUT_EVENT_ADAPTER, WIRE_MODELS

SCHEMA_DIR = Path(__file__).resolve().parent / "json"


def rendered_schemas() -> dict[str, str]:
    """File name -> JSON text, exactly as it should be on disk."""
    schemas = {name: model.model_json_schema() for name, model in WIRE_MODELS.items()}
    schemas["input-event"] = INPUT_EVENT_ADAPTER.json_schema()
    return {
        f"{name}.schema.json": json.dumps(schema, indent=2, sort_keys=True) + "\n"
        for name, schema in sorted(schemas.items())
    }


def main() -> None:
    SCHEMA_DIR.mkdir(exist_ok=True)
    for file_name, text in rendered_schemas().items():
        (SCHEMA_DIR / file_name).write_text(text, encoding="utf-8")
        print(SCHEMA_DIR / file_name)


if __name__ == "__main__":
    main()
