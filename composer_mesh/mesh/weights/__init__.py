"""The publisher -> subscriber weight plane: `config` (the `weights:` section, cheap), `plane` (publisher,
subscriber) and its transports (`rdma`, `shm`, `cuda_ipc`; chosen in `transports`)."""
