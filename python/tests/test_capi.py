"""The ctypes layer (rdep._capi) against include/rdep/capi.h: the struct mirrors have the header's field
order and types, and the offsets a C compiler gives them; every function of the header is bound; status
codes become the right exceptions; the library is found in the documented order.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import rdep
import rdep._capi as capi
from rdep._errors import error_for_code

REPO = Path(__file__).resolve().parents[2]
HEADER = REPO / "include" / "rdep" / "capi.h"
needs_header = pytest.mark.skipif(not HEADER.is_file(), reason=f"{HEADER} not found (not a source checkout)")


def _header_struct(name: str) -> list[tuple[str, str]]:
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    body = re.search(r"typedef struct %s \{(.*?)\} %s;" % (name, name), text, re.S).group(1)
    fields = []
    for decl in body.split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        m = re.fullmatch(r"(.*?[\s*])(\w+)", decl)
        fields.append((m.group(2), m.group(1).replace(" *", "*").strip()))
    return fields


@needs_header
@pytest.mark.no_library
@pytest.mark.parametrize("struct, mirror", [("rdep_domain_spec", capi.DOMAIN_SPEC_FIELDS),
                                            ("rdep_layer_spec", capi.LAYER_SPEC_FIELDS),
                                            ("rdep_rank_io", capi.RANK_IO_FIELDS),
                                            ("rdep_rank_rows", capi.RANK_ROWS_FIELDS),
                                            ("rdep_adamw_tensor", capi.ADAMW_TENSOR_FIELDS),
                                            ("rdep_adamw_step", capi.ADAMW_STEP_FIELDS)])
def test_struct_fields_match_the_header(struct, mirror):
    assert _header_struct(struct) == list(mirror)


@needs_header
@pytest.mark.no_library
def test_struct_layout_matches_the_c_compiler(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler on PATH")
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "rdep/capi.h"', "int main(void) {"]
    for struct, fields in (("rdep_domain_spec", capi.DOMAIN_SPEC_FIELDS), ("rdep_layer_spec", capi.LAYER_SPEC_FIELDS),
                           ("rdep_rank_io", capi.RANK_IO_FIELDS),
                           ("rdep_rank_rows", capi.RANK_ROWS_FIELDS), ("rdep_adamw_tensor", capi.ADAMW_TENSOR_FIELDS),
                           ("rdep_adamw_step", capi.ADAMW_STEP_FIELDS)):
        lines.append(f'printf("{struct} sizeof %zu\\n", sizeof({struct}));')
        for name, _ in fields:
            lines.append(f'printf("{struct} {name} %zu\\n", offsetof({struct}, {name}));')
    lines += ["return 0;", "}"]
    src, exe = tmp_path / "layout.c", tmp_path / "layout"
    src.write_text("\n".join(lines))
    subprocess.run([cc, "-I", str(REPO / "include"), str(src), "-o", str(exe)], check=True)
    got = {}
    for line in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines():
        struct, field, value = line.split()
        got[(struct, field)] = int(value)
    for struct, cls in (("rdep_domain_spec", capi.DomainSpec), ("rdep_layer_spec", capi.LayerSpec), ("rdep_rank_io", capi.RankIO),
                        ("rdep_rank_rows", capi.RankRows), ("rdep_adamw_tensor", capi.AdamWTensor),
                        ("rdep_adamw_step", capi.AdamWStep)):
        assert got[(struct, "sizeof")] == ctypes.sizeof(cls), struct
        for name, _ in cls._fields_:
            assert got[(struct, name)] == getattr(cls, name).offset, f"{struct}.{name}"


@needs_header
@pytest.mark.no_library
def test_every_header_function_is_bound():
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    declared = set(re.findall(r"\b(rdep_\w+)\s*\(", text)) - {"rdep_allgather_fn"}
    assert declared == set(capi._PROTOTYPES)


def test_library_loads_with_the_expected_version():
    info = rdep.library_info()
    assert info["capi_version"] == capi.CAPI_VERSION == 23
    assert Path(info["path"]).is_file()
    assert isinstance(info["built_with_cuda"], bool)


@pytest.mark.no_library
def test_status_codes_become_exceptions():
    e = error_for_code(1, "bad")
    assert isinstance(e, rdep.InvalidArgumentError) and isinstance(e, ValueError) and str(e) == "bad"
    for code, cls in ((2, rdep.FailedPreconditionError), (3, rdep.RdepTimeoutError), (4, rdep.UnavailableError),
                      (5, rdep.InternalError), (6, rdep.CudaError), (99, rdep.UnknownStatusError)):
        e = error_for_code(code, "m")
        assert isinstance(e, cls) and isinstance(e, RuntimeError) and isinstance(e, rdep.RdepError)
        assert not isinstance(e, ValueError)
        assert e.code == code


def test_error_message_comes_from_rdep_last_error():
    spec = capi.LayerSpec()
    spec.struct_size = 8  # wrong on purpose
    out = capi.LayerPtr()
    code = capi.lib().rdep_layer_create(ctypes.byref(spec), ctypes.byref(out))
    with pytest.raises(rdep.InvalidArgumentError, match=r"^rdep_layer_create: layer spec: struct_size 8"):
        capi.check(code, "rdep_layer_create")


@pytest.mark.no_library
def test_discovery_order(monkeypatch):
    monkeypatch.setenv("RDEP_LIBRARY", "/somewhere/librdep_capi.so")
    places = capi.candidate_paths()
    assert [why for why, _ in places] == ["RDEP_LIBRARY", "next to the rdep package", "build/lib of the source checkout"]
    assert places[0][1] == Path("/somewhere/librdep_capi.so")
    assert places[1][1] == Path(capi.__file__).resolve().parent / "librdep_capi.so"
    assert places[2][1] == REPO / "build" / "lib" / "librdep_capi.so"


@pytest.mark.no_library
def test_missing_library_is_a_clear_import_error():
    """A fresh interpreter: `import rdep` works without the library; first use says where it looked."""
    code = ("import rdep, rdep._capi as c\n"
            "try:\n    c.lib()\nexcept ImportError as e:\n    print('ImportError:', e)\n")
    env = dict(os.environ, RDEP_LIBRARY="/nonexistent/librdep_capi.so", PYTHONPATH=str(REPO / "python"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "ImportError: rdep: RDEP_LIBRARY=/nonexistent/librdep_capi.so is not a file" in out
