"""Model pairs: the demo pair built from local data, real pretrained pairs fetched from installed packages."""
