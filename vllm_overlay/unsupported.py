"""What ``register()`` installs on a vLLM the overlay does not support, and
on a supported one for the features that do not run there
(``version_gate.FEATURE_RELEASES``: on 0.32, the overlay's own connectors).

On an unsupported vLLM nothing of vLLM is patched and a configuration
without overlay features runs stock vLLM.  A configuration that asks for
the overlay must not run stock vLLM silently, nor run the overlay's
connectors against vLLM internals they were not written for: it gets one
startup error naming the supported versions and, where something on this
release does the same job, that (``version_gate.unsupported_error``,
``features.instead``: on 0.32, upstream's ``OffloadingConnector`` with
``cpu_bytes_to_use``, or the pool tier).  Uncaught, it prints as that one
line (``startup_errors``).  Each refusal sits on one of vLLM's public
extension points:

- the overlay's connector and offloading-spec names are registered with
  vLLM's factories (the plugin API) and resolve to this module.  A
  connector name's ``__getattr__`` raises the error (engine processes,
  whatever built the config); a spec name loads, as upstream's factory
  expects of every registered spec, as an ``OffloadingSpec`` that raises
  the error when it is built or asked for its metrics;
- ``EngineArgs.create_engine_config`` refuses an overlay connector, spec or
  ``vllm_overlay.*`` module path, and
  ``additional_config["enable_pp_prop_kv_cache"]``, in the front end before
  any engine process starts (``LLM``, ``vllm serve``);
- ``EngineArgs.add_cli_args`` keeps ``--enable-pp-prop-kv-cache`` known to
  ``vllm serve``, as a flag that refuses to be given (where the flag does
  not run; where it does, the patch set adds the real one).

``vllm_overlay.connectors`` itself refuses to be imported, so
``kv_connector_module_path`` cannot reach a connector past the gate.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging

from vllm_overlay.configured import engine_refusal
from vllm_overlay.version_gate import (
    CONNECTORS,
    FEATURE_RELEASES,
    OFFLOADING_SPECS,
    feature_runs_on,
    installed_vllm_version,
    listed,
    unsupported_error,
)

logger = logging.getLogger("vllm.overlay")

_GUARD = "_vllm_overlay_version_gate"


def __getattr__(name: str):
    # vLLM's factories resolve a registered name with getattr(module, name).
    if name in CONNECTORS:
        raise unsupported_error(
            [f"kv_connector {name!r}"], installed_vllm_version(), "connectors"
        )
    if name in OFFLOADING_SPECS:
        return _refused_spec(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _spec_error(name: str):
    return unsupported_error(
        [f"kv_connector_extra_config spec_name {name!r}"],
        installed_vllm_version(),
        "connectors",
    )


@functools.cache
def _refused_spec(name: str) -> type:
    """An ``OffloadingSpec`` named NAME that loads (upstream's factory
    loads every registered spec) and refuses to be used."""
    from vllm.v1.kv_offload.base import OffloadingSpec

    def __init__(self, config, *args, **kwargs):
        raise _spec_error(name)

    def build_metric_definitions(cls, extra_config):
        raise _spec_error(name)

    def refused(self, *args, **kwargs):
        raise _spec_error(name)

    return type(
        name,
        (OffloadingSpec,),
        {
            "__module__": __name__,
            "__doc__": f"{name}: refused on this vLLM (the overlay's spec).",
            "__init__": __init__,
            "build_metric_definitions": classmethod(build_metric_definitions),
            "get_manager": refused,
            "get_worker": refused,
        },
    )


def install() -> None:
    """Install every refusal this vLLM allows; one that cannot be installed
    (an extension point gone in this vLLM) is logged, the others still
    apply, and stock vLLM still runs."""
    from vllm_overlay.startup_errors import install_hook

    install_hook()  # an uncaught refusal prints as its one line
    for step in (_register_names, _guard_engine_config, _guard_cli_flag):
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - stock vLLM must still start
            logger.warning(
                "vllm-overlay: %s not installed on this vLLM (%s: %s)",
                step.__name__.lstrip("_").replace("_", " "),
                type(exc).__name__,
                exc,
            )


def _register_names() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    # A name already registered (by someone else) is left alone: vLLM
    # raises ValueError for it.
    for name in CONNECTORS:
        with contextlib.suppress(ValueError):
            KVConnectorFactory.register_connector(name, __name__, name)
    for name in OFFLOADING_SPECS:
        with contextlib.suppress(ValueError):
            OffloadingSpecFactory.register_spec(name, __name__, name)


def _guard_engine_config() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, _GUARD, False):
        return

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        error = engine_refusal(self, installed_vllm_version())
        if error is not None:
            raise error
        return original(self, *args, **kwargs)

    setattr(create_engine_config, _GUARD, True)
    EngineArgs.create_engine_config = create_engine_config


class _RefusedFlag(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        kwargs.update(nargs=0, default=argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        error = unsupported_error(
            [option_string], installed_vllm_version(), "pp_prop_kv_cache"
        )
        raise argparse.ArgumentError(self, str(error))


def _guard_cli_flag() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from vllm_overlay.integration import pp_kv

    if feature_runs_on("pp_prop_kv_cache", installed_vllm_version()):
        return  # the release's patch set adds the working flag
    original = EngineArgs.add_cli_args
    if getattr(original, _GUARD, False):
        return

    @functools.wraps(original)
    def add_cli_args(parser, *args, **kwargs):
        parser = original(parser, *args, **kwargs)
        parser.add_argument(
            pp_kv.CLI_FLAG,
            "--no-" + pp_kv.CLI_FLAG[2:],
            action=_RefusedFlag,
            help="(vllm-overlay) Not available: needs vLLM "
            f"{listed(FEATURE_RELEASES['pp_prop_kv_cache'])}, this is vLLM "
            f"{installed_vllm_version()}.",
        )
        return parser

    setattr(add_cli_args, _GUARD, True)
    EngineArgs.add_cli_args = staticmethod(add_cli_args)
