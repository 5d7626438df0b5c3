"""Topology schema and launch, the RDMA weight plane and the object-store (DiLoCo) plane. No model code."""
