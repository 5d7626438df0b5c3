"""The coding task family: fix or write a small Python module with file, test and Python tools that run in the
sandbox (`composer_mesh.sandbox`); the reward is the fraction of hidden tests passed. See docs/sandbox.md.

`config` is import-cheap; `catalog` holds the shipped tasks; `session` the episode (`CodingSession`);
`environment` the run's prompts and their episodes (`CodingEnvironment`)."""
