"""yolo5l's Hydra configs (`pkg://yolo5l.conf`); importing the package registers the resolvers they use."""

import yolo5l.base.resolvers  # noqa: F401
