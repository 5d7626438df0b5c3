"""DiLoCoConfig refuses settings that silently diverge or leak secrets, naming the field."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from composer_mesh.mesh.objectstore import DiLoCoConfig

BASE = {"store_uri": "file:///tmp/diloco", "run_id": "r1"}


def test_defaults_follow_the_paper():
    c = DiLoCoConfig(**BASE)
    assert (c.outer_optimizer.lr, c.outer_optimizer.momentum, c.outer_optimizer.nesterov) == (0.7, 0.9, True)
    assert c.compression == "none" and c.fragments == 1 and c.bucket_cap_mb is None
    for name, f in DiLoCoConfig.model_fields.items():
        assert f.description, f"{name} has no description"


@pytest.mark.parametrize(("overrides", "needle"), [
    ({"store_uri": "ftp://x/y"}, "scheme must be one of"),
    ({"store_uri": "s3://"}, "needs a path"),
    ({"run_id": "a/b"}, "run_id"),
    ({"sync_every": 5, "fragments": 2}, "divisible by fragments"),
    ({"sync_every": 4, "fragments": 2, "fragment_sync_delay": 2}, "fragment_sync_delay=2 must be <"),
    ({"sync_every": 4, "fragments": 2, "outer_optimizer": {"scope": "shared"}}, "silently diverges"),
    ({"outer_optimizer": {"momentum": 0.0}}, "nesterov"),
    ({"storage_options": {"secret": "abc123"}}, "credentials_env"),
    ({"credentials_env": {"key": "not a name"}}, "not an environment variable name"),
    ({"compression": "fp8"}, "compression"),
    ({"sync_evry": 3}, "sync_evry"),
    ({"quorum_deadline_s": 0}, "quorum_deadline_s"),
])
def test_refused(overrides, needle):
    with pytest.raises(ValidationError) as ei:
        DiLoCoConfig(**{**BASE, **overrides})
    assert needle in str(ei.value)
    assert "abc123" not in str(ei.value)  # inputs are hidden from errors: they may hold secrets


def test_secret_value_never_in_message():
    with pytest.raises(ValidationError) as ei:
        DiLoCoConfig(**{**BASE, "storage_options": {"password": "hunter2"}})
    assert "hunter2" not in str(ei.value)


def test_bucket_cap_checked_against_largest_tensor():
    c = DiLoCoConfig(**BASE, bucket_cap_mb=0.01)  # 10485 bytes
    c.check_against({"small": (10, 10)})
    with pytest.raises(ValueError, match=r"'big'.*40000 bytes.*silently skip"):
        c.check_against({"small": (10, 10), "big": (100, 100)})
    with pytest.raises(ValueError, match="no parameters"):
        c.check_against({})


def test_wrapper_refuses_small_bucket_before_touching_the_store(tmp_path):
    from composer_mesh.mesh.objectstore.diloco import ObjectStoreDiLoCo

    model = torch.nn.Linear(64, 64)
    c = DiLoCoConfig(store_uri=f"file://{tmp_path}/s", run_id="r", bucket_cap_mb=0.001)
    with pytest.raises(ValueError, match="weight"):
        ObjectStoreDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), c, 0)
    assert not (tmp_path / "s").exists()


def test_replica_id_range(tmp_path):
    from composer_mesh.mesh.objectstore.manager import ObjectStoreManager

    with pytest.raises(ValueError, match="replica_id=2"):
        ObjectStoreManager(DiLoCoConfig(store_uri=f"file://{tmp_path}/s", run_id="r", replicas=2), 2)
