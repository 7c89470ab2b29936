"""Init container of the pagedserve chart: write the model repository tritonserver serves.

It copies the source repository (the image's, or a mounted one) with the chart's
`engine` values set as parameters of the config.pbtxt of `llm` (the engine's model), through the same
function `pagedserve serve --set` uses, so the settings are validated by EngineConfig
before tritonserver starts: an unknown name, a bad value or a `model` path that does
not exist fails this container with the parameter named.

Environment (set by the chart):
  PAGEDSERVE_MODEL_REPOSITORY    the source repository
  PAGEDSERVE_RUNTIME_REPOSITORY  where to write the copy (tritonserver's --model-repository)
  PAGEDSERVE_ENGINE              the `engine` values as a JSON object
"""

from __future__ import annotations

import json
import os
import sys

from pagedserve.backend.errors import ConfigError
from pagedserve.backend.triton_adapter.arguments import ENGINE_MODEL, pbtxt_parameters
from pagedserve.client.repository import source_repository, write_repository


def as_text(value: object) -> str:
    """A values.yaml scalar as config.pbtxt's string (Helm hands numbers over as floats)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def main() -> int:
    engine = json.loads(os.environ.get("PAGEDSERVE_ENGINE") or "{}")
    if not isinstance(engine, dict):
        print(f"pagedserve: `engine` must be a mapping of engine parameters, got {engine!r}", file=sys.stderr)
        return 2
    settings = {str(key): as_text(value) for key, value in engine.items()}
    try:
        source = source_repository()
        model = settings.pop("model", None)
        if model is None:  # keep the source repository's own model (write_repository always sets one)
            model = pbtxt_parameters((source / ENGINE_MODEL / "config.pbtxt").read_text()).get("model", "")
        written = write_repository(os.environ["PAGEDSERVE_RUNTIME_REPOSITORY"], model=model, engine=settings)
    except (ConfigError, FileNotFoundError) as error:
        print(f"pagedserve: cannot write the model repository: {error}", file=sys.stderr)
        return 2
    print(f"pagedserve: wrote {written} from {source} with engine parameters "
          f"{json.dumps({'model': model, **settings}, sort_keys=True)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
