"""The run configuration: the frozen dataclass schema, YAML loading with overrides, and building the recipe, model and optimizer from it."""
