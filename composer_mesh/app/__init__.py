"""Entry points that take a whole topology: `launch(topology)` (role actors on their meshes) and the runner
behind `composer-mesh run`."""
