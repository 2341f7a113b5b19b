"""Megatron-LM's own argument parser, used two ways on a Megatron-LM source tree (no install needed):

  python tests/data/megatron_args.py list MEGATRON_DIR > tests/data/megatron_args.txt
      every option string of ``add_megatron_arguments`` (megatron/training/arguments.py, the parser of
      pretrain_gpt.py); update the commit named in that file's header and in planner/exports/megatron.py.
  WORLD_SIZE=N python tests/data/megatron_args.py check MEGATRON_DIR megatron.sh
      sources an exported fragment and runs Megatron's parse_args, validate_args and TransformerConfig on
      its MEGATRON_ARGS (a deeper check than flag names; prints the degrees Megatron derived).

Megatron imports triton and Transformer Engine in places this CPU check never calls: modules importing
triton at top level are replaced by stubs; Python 3.11 gets typing.override; rope fusion (a TE kernel)
is switched off before the TransformerConfig is built.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import pathlib
import re
import subprocess
import sys
import types
import typing
from unittest import mock


class _Stub(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return mock.MagicMock(name=f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, prefixes: set[str]):
        self.prefixes = prefixes

    def find_spec(self, fullname, path, target=None):
        if any(fullname == p or fullname.startswith(p + ".") for p in self.prefixes):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Stub(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def _import_megatron(root: pathlib.Path):
    triton_users = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
                    for p in (root / "megatron").rglob("*.py")
                    if re.search(r"^(import triton|from triton)", p.read_text(errors="ignore"), re.M)}
    sys.meta_path.insert(0, _StubFinder(triton_users))
    if not hasattr(typing, "override"):
        typing.override = lambda f: f
    sys.path.insert(0, str(root))
    import megatron.training.arguments as arguments

    return arguments


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("action", choices=("list", "check"))
    parser.add_argument("megatron_dir", type=pathlib.Path)
    parser.add_argument("fragment", nargs="?")
    a = parser.parse_args()
    arguments = _import_megatron(a.megatron_dir)
    if a.action == "list":
        p = argparse.ArgumentParser(allow_abbrev=False)
        arguments.add_megatron_arguments(p)
        print("\n".join(sorted({o for action in p._actions for o in action.option_strings})))
        return
    argv = subprocess.run(["bash", "-c", 'source "$1"; printf "%s\\n" "${MEGATRON_ARGS[@]}"', "_", a.fragment],
                          capture_output=True, text=True, check=True).stdout.splitlines()
    arguments.get_device_arch_version = lambda: 9  # Hopper: no GPU here to ask
    sys.argv = ["pretrain_gpt.py", *argv]
    args = arguments.parse_args()
    arguments.validate_args(args)
    args.apply_rope_fusion = False
    config = arguments.core_transformer_config_from_args(args)
    print(f"Megatron-LM accepted it: dp {args.data_parallel_size}, tp {args.tensor_model_parallel_size}, pp "
          f"{args.pipeline_model_parallel_size}, vpp {args.virtual_pipeline_model_parallel_size}, micro-batch "
          f"{args.micro_batch_size}, global batch {args.global_batch_size}, layers {config.num_layers}, "
          f"recompute {config.recompute_granularity}")


if __name__ == "__main__":
    main()
