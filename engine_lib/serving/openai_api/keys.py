"""Who may call the front door, and how urgent a `priority` each caller may ask for.

OPENAI_API_KEY is one bearer key; OPENAI_PRIORITY_KEYS is `<key>=<level>,...`, bearer keys
that may also ask for `priority` down to `<level>` (1 is the most urgent). The model itself
refuses a level more urgent than its default (`default_priority_level`) unless the request
carries its `priority_key` parameter (DIFFUSION_PRIORITY_KEY): the front door forwards that
for its priority keys only, and refuses (403, naming `priority`) a level past a caller's
rights before the request reaches the model. Without any key the door is open and nobody
passes the model's default.

Keys are compared with `hmac.compare_digest` against every accepted key, so the time an
answer takes does not tell how much of a guessed key was right, nor which key it matched.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from engine_lib.serving.openai_api.requests import OpenAIError


@dataclass(frozen=True)
class Caller:
    """An accepted caller: `highest` is the most urgent priority level it may ask for (None: the model's
    default; no key of OPENAI_PRIORITY_KEYS); `owner` names its key (a digest, never the key) for what it
    owns, video jobs (empty: the open door's one caller)."""

    highest: Optional[int] = None
    owner: str = ""


def parse_priority_keys(text: str) -> dict[str, int]:
    """OPENAI_PRIORITY_KEYS (`<key>=<level>,...`) as key -> level. A malformed entry raises ValueError
    naming it by its position, never by its text (which holds a key)."""
    keys: dict[str, int] = {}
    if not text.strip():
        return keys
    entries = text.split(",")
    for number, entry in enumerate(entries, 1):
        where = f"OPENAI_PRIORITY_KEYS entry {number} of {len(entries)}"
        key, equals, level = entry.strip().rpartition("=")  # the last '=': a key may hold '=' (base64)
        if not equals or not key:
            raise ValueError(f"{where} is not <key>=<level>")
        if not level.isdecimal() or int(level) < 1:
            raise ValueError(f"{where}: the level after the last '=' is not an integer >= 1 (1 is the most urgent)")
        if key in keys:
            raise ValueError(f"{where} repeats the key of an earlier entry")
        keys[key] = int(level)
    return keys


class FrontDoorKeys:
    """The accepted bearer keys and the priority rights of each (see the module docstring)."""

    def __init__(self, api_key: str = "", priority_keys: Optional[Mapping[str, int]] = None, model_key: str = ""):
        rights = {api_key: None} if api_key else {}
        rights.update(priority_keys or {})  # a key in both has its priority rights
        self._keys = [(key.encode("utf-8"), Caller(level, hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]))
                      for key, level in rights.items()]
        self.model_key = model_key  # DIFFUSION_PRIORITY_KEY: the `priority_key` the model asks for

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "FrontDoorKeys":
        """From OPENAI_API_KEY, OPENAI_PRIORITY_KEYS and DIFFUSION_PRIORITY_KEY; ValueError if malformed."""
        return cls(environ.get("OPENAI_API_KEY", ""), parse_priority_keys(environ.get("OPENAI_PRIORITY_KEYS", "")),
                   environ.get("DIFFUSION_PRIORITY_KEY", ""))

    @property
    def open(self) -> bool:
        return not self._keys

    def caller(self, token: Optional[str]) -> Optional[Caller]:
        """The caller whose key `token` is (None: no accepted key). Every key is compared, in constant time."""
        if self.open:
            return Caller()
        given = (token or "").encode("latin-1")  # Starlette decodes header bytes as latin-1: back to the bytes sent
        found = None
        for key, caller in self._keys:
            if hmac.compare_digest(given, key):
                found = caller
        return found

    def priority_parameters(self, caller: Caller, priority: Any, default: Optional[int]) -> dict[str, str]:
        """The request parameters that let the model run `priority` for `caller`: `priority_key` for a level
        within a priority key's rights, none otherwise. A level past the caller's rights raises 403; a value
        that is no level (absent, 0, not an integer) is left to the model's own checks. `default` is the
        model's default level (None: unknown; then the model refuses what the caller may not ask)."""
        if isinstance(priority, bool) or not isinstance(priority, int) or priority < 1:
            return {}
        if caller.highest is None:
            if default is not None and priority < default:
                raise OpenAIError(403, f"priority {priority} is more urgent than the model's default ({default}); "
                                       f"it needs a bearer key with priority rights (OPENAI_PRIORITY_KEYS)",
                                  param="priority", code="permission_denied")
            return {}
        if priority < caller.highest:
            raise OpenAIError(403, f"priority {priority} is more urgent than this key may ask for (at most "
                                   f"{caller.highest})", param="priority", code="permission_denied")
        return {"priority_key": self.model_key} if self.model_key else {}
