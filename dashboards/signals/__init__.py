"""The panels of both dashboards, each written once and parameterised by a `View`.

One module per family of signals; each holds the family's overview stat and its graphs,
and the fleet and target dashboards pick from them.
"""
