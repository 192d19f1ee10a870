"""What every replica of an app that serves a hub id needs from the environment of the machine
that builds the app, to fetch the model on its own node: the hub token, and the settings a
whole cluster shares. They travel in each deployment's `runtime_env.env_vars`
(`app.deployment_options`), which override what a node's own Ray was started with.

- `HF_TOKEN`: the builder's token (`HF_TOKEN`, else the one `hf auth login` stored), for a
  gated or private repository; each replica downloads its weights with it.
- `HF_ENDPOINT` (a mirror) and `HF_HUB_OFFLINE` (caches filled beforehand, no hub), when set:
  the builder resolved the revision through them, so the replicas must fetch through them too.
- Not `HF_HOME` / `HF_HUB_CACHE`: a cache is a node's own, and the builder's path need not
  exist, or be writable, on another node; a node sets its own in the environment of `ray start`.

The token is never logged or printed by pdserve, and is not part of `AppConfig` (so not of
its dict form or of a Serve config pdserve writes). Ray keeps a deployment's options, env vars
included, in Serve's controller, where the dashboard's Serve API lists them: whoever can reach
the dashboard can read it, as they can already run any code on the cluster.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from cluster.config import ModelConfig
from cluster.model.hub import is_hub_id

# Cluster-wide hub settings, forwarded as the builder has them.
SHARED_SETTINGS = ("HF_ENDPOINT", "HF_HUB_OFFLINE")
TOKEN = "HF_TOKEN"


def hub_env_vars(model: ModelConfig, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The env vars every replica gets for `model`: none for a local directory; for a hub id,
    `SHARED_SETTINGS` that are set in `environ` (default: this process's) and the token, if
    the builder has one."""
    if not is_hub_id(model.path):
        return {}
    environ = os.environ if environ is None else environ
    env = {k: environ[k] for k in SHARED_SETTINGS if environ.get(k)}
    token = environ.get(TOKEN) or _stored_token()
    if token:
        env[TOKEN] = token
    return env


def _stored_token() -> str | None:
    """The token `hf auth login` stored on this machine, if any."""
    from huggingface_hub import get_token

    try:
        return get_token()
    except Exception:  # an unreadable token file, or a failed exchange: no token
        return None
