"""Bundled tiny model and demo data (made by scripts/build_assets.py)."""
