"""Multi-turn tool use: parsing calls (`parsers`), schemas (`schema`), tools (`registry`), runs (`runner`)."""
