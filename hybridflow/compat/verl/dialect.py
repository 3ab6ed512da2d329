"""The verl dialect of RunConfig: verl's key names and, for a run written with them, verl's defaults.

`load_config(RunConfig, ...)` calls `VERL.translate` on every layer (YAML file, overrides) before any dataclass
is built:

- a key in `verl_keys.NULL_IS_UNSET` set to null is dropped (verl's "not set": hybridflow's default holds);
- a key in `verl_keys.RENAMED` becomes hybridflow's key (its value translated where `verl_keys.VALUES` says);
  in a layer that names the reward model's inference engine (`reward_model.rollout.name`), the keys of
  `verl_keys.GENERATIVE_RM` become the judge's (verl's generative reward model is hybridflow's judge);
- a key in `verl_keys.SETS` sets the hybridflow keys its value names (another value is a problem line);
- a key in `verl_keys.NO_EFFECT` is dropped; the entry `*._target_` covers every key whose last part is
  `_target_` (Hydra class paths);
- a key in `verl_keys.NOT_YET` set to a value that leaves the feature off, or to one of its
  `verl_keys.ACCEPTED` values (verl's own default among them where that is what hybridflow does), is dropped;
- the dropped keys of a layer are logged in ONE warning, a line per reason naming its keys (verl's whole
  generated config, every key at its default, loads with one summary instead of ~300 lines);
- any other key in `verl_keys.NOT_YET`, or any other `actor_rollout_ref.*` key, is returned as a problem line
  (load_config reports every problem and unknown key of a run at once);
- `trainer.logger=console` (a string, as verl accepts) becomes `[console]`.

`${...}` values were resolved before `translate`, against all layers as written (utils/config_loader.py), as Hydra does.

THE DEFAULTS RULE: a run whose layers use any key hybridflow spells differently (a key of RENAMED, NO_EFFECT
or NOT_YET) starts from `verl_keys.VERL_DEFAULTS` on top of hybridflow's defaults, so what the script does not
set behaves as in verl; the values that differ from hybridflow's own are logged (stderr) when that happens.
A run written with hybridflow's names only is untouched.
"""

from __future__ import annotations

import difflib
import json
import logging
from typing import Any

from hybridflow.compat.verl import keys as verl_keys

log = logging.getLogger("hybridflow.config")


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    """Dotted leaf keys of a nested mapping (an empty mapping is a leaf)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def nest(flat: dict[str, Any]) -> dict:
    """The nested mapping of dotted keys (inverse of `flatten`)."""
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def lookup(table: dict[str, Any], key: str) -> Any:
    """`table[key]`, or the entry of the nearest `prefix.*` covering `key`, or the entry `*.leaf` for the last
    part of `key`; None when none exists."""
    if key in table:
        return table[key]
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        star = ".".join(parts[:end]) + ".*"
        if star in table:
            return table[star]
    return table.get("*." + parts[-1])


def is_verl_name(key: str) -> bool:
    """Whether `key` is one of verl's names that hybridflow spells differently (or lacks)."""
    tables = (verl_keys.RENAMED, verl_keys.SETS, verl_keys.NO_EFFECT, verl_keys.NOT_YET)
    return key.startswith(verl_keys.A + ".") or any(lookup(t, key) is not None for t in tables)


class VerlDialect:
    """The hook `load_config` calls for RunConfig (see the module docstring)."""

    def translate(self, data: dict, source: str) -> tuple[dict, list[str]]:
        """`data` (one layer) with verl's names replaced, and one problem line per refused key. The keys accepted
        without effect are logged in one summary (one warning per layer, a line per reason)."""
        out, problems, ignored, names = {}, [], {}, {}
        flat = flatten(data)
        generative = flat.get("reward_model.rollout.name") not in (None, "???")
        for key, value in flat.items():
            mine = verl_keys.GENERATIVE_RM.get(key) if generative else None
            mine = mine or verl_keys.RENAMED.get(key) or verl_keys.RENAMED.get(_any_name(key, names))
            if value is None and key in verl_keys.NULL_IS_UNSET:
                continue
            if mine is not None:
                value = verl_keys.VALUES.get(mine, {}).get(value, value) if _hashable(value) else value
                out[mine] = value
                if mine == "trainer.n_workers_per_node" and value:
                    log.warning(
                        "%s: %s=%s means %s worker processes here (on CPU: processes, not GPUs); "
                        "trainer.n_workers_per_node=null lets hybridflow pick them for this machine",
                        source,
                        key,
                        value,
                        value,
                    )
            elif key in verl_keys.SETS:
                sets = verl_keys.SETS[key].get(value) if _hashable(value) else None
                if sets is None:
                    problems.append(
                        f"{key}={value!r} is not one of the values hybridflow reads: {list(verl_keys.SETS[key])}"
                    )
                else:
                    out.update(sets)
            elif (why := self._ignored(key, value)) is not None:
                ignored.setdefault(why, []).append(f"{key}={_show(value)}")
            elif (what := _entry(verl_keys.NOT_YET, key)) is not None:
                problems.append(f"{key!r} is verl's; hybridflow has no {what} yet")
            elif key.startswith(verl_keys.A + "."):
                problems.append(f"{key!r} is not one of verl's keys hybridflow knows{_near_verl(key)}")
            else:  # spelled as in verl; VALUES may still translate verl's value (critic.optim's -1 steps)
                out[key] = verl_keys.VALUES.get(key, {}).get(value, value) if _hashable(value) else value
        problems += [
            f"{section}.* names {len(seen)} entries ({', '.join(sorted(seen))}); hybridflow distills from one teacher"
            for section, seen in names.items()
            if len(seen) > 1
        ]
        _log_ignored(ignored, source)
        _warn_unused_memory_fraction(out, source)
        if isinstance(out.get("trainer.logger"), str):
            out["trainer.logger"] = [out["trainer.logger"]]
        return nest(out), problems

    @staticmethod
    def _ignored(key: str, value: Any) -> str | None:
        """Why verl key `key` set to `value` is accepted without effect here, or None when it is not."""
        if (why := _entry(verl_keys.NO_EFFECT, key)) is not None:
            return f"no effect here: {why}"
        what = _entry(verl_keys.NOT_YET, key)
        if what is None:
            return None
        if _is_off(value):  # e.g. trainer.val_only=False: the feature off is what hybridflow does
            return f"accepted: hybridflow has no {what}, which this value leaves off"
        if _accepted(key, value):  # e.g. optim.optimizer=AdamW: the one optimizer hybridflow has
            return f"accepted: it is what hybridflow does (it has no {what})"
        return None

    def base_layer(self, layers: list[dict]) -> dict | None:
        """verl's defaults (nested) when any layer uses a verl-only name, else None (see the defaults rule)."""
        trigger = next((k for layer in layers for k in flatten(layer) if is_verl_name(k)), None)
        if trigger is None:
            return None
        user = {verl_keys.RENAMED.get(k, k) for layer in layers for k in flatten(layer)}  # hybridflow keys the run sets
        changed = [
            f"{k}={_show(v)}" for k, v in verl_keys.VERL_DEFAULTS.items() if k not in user
        ]  # `${a.b}`: follows a.b
        log.info(
            "verl key names found (%s, ...): this run starts from verl's defaults (docs/verl.md); "
            "in effect where they differ from hybridflow's: %s",
            trigger,
            ", ".join(changed) or "none",
        )
        return nest(dict(verl_keys.VERL_DEFAULTS))

    def hint(self, key: str) -> str:
        """For a hybridflow key that does not exist: "; `verl key` is `hybridflow key` here" where one fits: the
        renamed verl key that is `key` under a prefix (`rollout.log_prob_micro_batch_size_per_gpu` is verl's
        `actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu`), else one whose hybridflow key is in
        `key`'s section and whose verl key ends with the rest of `key` (`actor.ppo_micro_batch_size_per_gpu`)."""
        for verl, mine in verl_keys.RENAMED.items():
            if verl.endswith("." + key):
                return f"; {verl!r} is {mine!r} here"
        section, _, rest = key.partition(".")
        for verl, mine in verl_keys.RENAMED.items():
            if rest and verl.endswith("." + rest) and mine.startswith(section + "."):
                return f"; {verl!r} is {mine!r} here"
        return ""


def _any_name(key: str, names: dict[str, set[str]]) -> str:
    """`key` with the user-chosen name of a `verl_keys.NAMED` section as `*` (recording the name in `names`), or
    `key` unchanged."""
    for section in verl_keys.NAMED:
        if key.startswith(section + "."):
            name, _, rest = key[len(section) + 1 :].partition(".")
            if rest:
                names.setdefault(section, set()).add(name)
                return f"{section}.*.{rest}"
    return key


def _near_verl(key: str) -> str:
    known = list(verl_keys.RENAMED) + list(verl_keys.SETS) + list(verl_keys.NO_EFFECT) + list(verl_keys.NOT_YET)
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    if not near:
        return "; see docs/verl.md"
    target = verl_keys.RENAMED.get(near[0])
    return f"; did you mean {near[0]!r}" + (f" ({target!r} here)?" if target else "?")


def _log_ignored(ignored: dict[str, list[str]], source: str) -> None:
    """One warning for the verl keys of a layer accepted without effect: a line per reason, naming its keys."""
    if ignored:
        count = sum(len(keys) for keys in ignored.values())
        lines = "".join(f"\n  {why}: {', '.join(keys)}" for why, keys in ignored.items())
        log.warning("%s: %d of verl's keys change nothing here (by reason):%s", source, count, lines)


def _warn_unused_memory_fraction(layer: dict[str, Any], source: str) -> None:
    """rollout.gpu_memory_utilization sizes only vllm on a GPU: one warning when the layer sets it for another
    rollout or device (as written in the same layer; hybridflow's defaults: native, cpu). verl's generated
    config leaves rollout.name `???` (unset: another layer names it): no warning from that layer."""
    if "rollout.gpu_memory_utilization" not in layer or layer.get("rollout.name") == "???":
        return
    name, device = layer.get("rollout.name", "native"), layer.get("trainer.device", "cpu")
    if name != "vllm" or device != "cuda":
        log.warning(
            "%s: rollout.gpu_memory_utilization=%s has no effect with rollout.name=%s on trainer.device=%s: "
            "only vllm on a GPU sizes its memory by it",
            source,
            layer["rollout.gpu_memory_utilization"],
            name,
            device,
        )


def _entry(table: dict[str, str], key: str) -> str | None:
    """`lookup(table, key)`, unless another table names `key` exactly (an exact entry beats a `prefix.*`)."""
    if key not in table and any(
        key in other for other in (verl_keys.RENAMED, verl_keys.SETS, verl_keys.NO_EFFECT, verl_keys.NOT_YET)
    ):
        return None
    return lookup(table, key)


def _is_off(value: Any) -> bool:
    """A value that switches a feature off (false, null, 0, -1, empty)."""
    return value is None or value is False or (type(value) is int and value in (0, -1)) or value in ("", [], {})


def _accepted(key: str, value: Any) -> bool:
    """Whether `value` is one of the `verl_keys.ACCEPTED` values of NOT_YET key `key`."""
    return value in verl_keys.ACCEPTED.get(key, ())  # by ==: a list value matches a list entry


def _hashable(value: Any) -> bool:
    return not isinstance(value, (list, dict))


def _show(value: Any) -> str:
    """`value` as one word where it can be: null, lists and mappings without spaces (the summary's separator is
    ", ")."""
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return "null" if value is None else str(value)


VERL = VerlDialect()
"""The dialect RunConfig declares (`RunConfig.key_dialect`)."""
