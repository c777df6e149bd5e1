"""What a run is asked to do: the recipe, read and checked before anything loads.

    messages    dotted key=value overrides; one clear line per schema problem (did you mean, moved keys)
    files       recipe files and bundled assets: found (shipped name or path) and read
    older_runs  an older run's recipe as this version spells it (resume compares recipes)
    sections    the recipe's sections (model, data, ..., memory): the only place defaults live
    schema      RecipeConfig: the sections together and the cross-field rules, asked of the
                declarations that stand before it (adapters/, declarations/techniques, declarations/objectives,
                declarations/zero_config and declarations/compression)

The schema's entry points are re-exported here: `from finetune.config import load_recipe`.
"""

from finetune.config.schema import RecipeConfig, build_recipe, load_recipe, resolve_path

__all__ = ["RecipeConfig", "build_recipe", "load_recipe", "resolve_path"]
