"""A secret pasted into a topology is rejected without being echoed, by the CLI and by raw pydantic errors."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from composer_mesh.topology import Topology, TopologyError, parse_topology

SECRET = "SUPERSECRET-9f8e7d"
TEXT = f"""
name: sec
meshes:
  trainer: {{backend: local, procs_per_host: 2}}
  g: {{backend: local}}
  r: {{backend: local}}
roles:
  trainer: {{mesh: trainer, binding: hf, replicas: 2}}
  generators: {{mesh: g, binding: hf}}
  rewarder: {{mesh: r, binding: python, settings: {{functions: [{{path: "composer_mesh.tasks.arithmetic:exact_match"}}]}}}}
loss: {{alpha_sdpo: 0, beta_replay: 0}}
diloco:
  store_uri: s3://bucket/x
  run_id: r1
  storage_options: {{secret: {SECRET}}}
  quorum_deadline_s: {SECRET}
"""


def test_topology_error_names_the_field_but_not_the_secret():
    with pytest.raises(TopologyError) as e:
        parse_topology(TEXT, source="<test>")
    text = str(e.value)
    assert "diloco.storage_options" in text and "credentials_env" in text
    assert "diloco.quorum_deadline_s" in text
    assert SECRET not in text


def test_raw_pydantic_error_message_hides_inputs():
    with pytest.raises(ValidationError) as e:
        Topology.model_validate(yaml.safe_load(TEXT))
    assert "quorum_deadline_s" in str(e.value) and SECRET not in str(e.value)
