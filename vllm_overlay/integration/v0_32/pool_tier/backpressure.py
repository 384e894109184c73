"""The pool tier's back-pressure detector, built for the locality the tier
reports.

Upstream's ``SecondaryTierFactory.create_secondary_tier`` (0.32 and 0.33,
``tiering/factory.py``) builds a tier's detector before the tier exists,
filling the keys the entry's ``backpressure`` leaves out from
``detector_cls.default_config(tier_type, locality=entry.get("locality"))``:
upstream's EMA detector gets the network watermarks for ``REMOTE`` and the
local-disk ones (5x lower) for anything else, ``None`` included.  The pool
is remote unless its entry says otherwise, so an entry without
``locality`` gave a tier that reports REMOTE a detector tuned for a local
NVMe disk: pressure at 0.010 s/MiB instead of 0.050, on a network pool.

``for_locality`` gives the detector the factory would have built had the
entry named the tier's locality: the same class and policy, the entry's own
``backpressure`` keys, and that locality's defaults for the rest.  It
changes nothing when the entry names its locality, when there is no
detector, or when the detector's defaults do not depend on locality."""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.overlay")

# What upstream's factory takes out of an entry before the tier gets it.
_FACTORY_KEYS = ("type", "module_path", "backpressure")


def for_locality(detector, offloading_spec, tier_type: str, options: dict, locality):
    """``detector`` (upstream's factory built it, None: none), as built for
    ``locality`` (``LOCAL``/``REMOTE``); ``options``: what the factory
    passed the tier (its entry, less ``_FACTORY_KEYS``)."""
    if detector is None or options.get("locality") is not None:
        return detector  # the factory used the entry's own locality
    cls = type(detector)
    wanted = cls.default_config(tier_type, locality=locality) or {}
    given = cls.default_config(tier_type, locality=None) or {}
    if wanted == given:
        return detector
    config = _own_backpressure(offloading_spec, tier_type, options)
    if config is None:
        raise ValueError(
            f"{tier_type}: upstream's factory picked this tier's back-pressure "
            f"defaults for locality None ({given}), not for the tier's "
            f"{locality} ({wanted}), and its entry could not be found among "
            "secondary_tiers to build them again; set locality in the entry "
            "(REMOTE for a network pool)"
        )
    config = dict(config)
    config.pop("backpressure_cls", None)
    config.pop("policy_cls", None)
    for key, value in wanted.items():
        config.setdefault(key, value)
    logger.info(
        "vllm-overlay KV pool tier: back-pressure defaults for a %s tier (%s); "
        "the entry names no locality, so upstream's factory had picked %s",
        locality,
        wanted,
        given,
    )
    return cls(policy=detector.policy, **config)


def _own_backpressure(offloading_spec, tier_type: str, options: dict) -> dict | None:
    """The ``backpressure`` of this tier's entry in ``secondary_tiers``
    (the entries of its type whose other keys are ``options``; None when
    they disagree or none is found)."""
    extra = getattr(offloading_spec.config, "extra_config", None) or {}
    found = [
        entry["backpressure"]
        for entry in extra.get("secondary_tiers") or []
        if entry.get("type") == tier_type
        and isinstance(entry.get("backpressure"), dict)
        and {k: v for k, v in entry.items() if k not in _FACTORY_KEYS} == options
    ]
    if not found or any(f != found[0] for f in found):
        return None
    return found[0]
