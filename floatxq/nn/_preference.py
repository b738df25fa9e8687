"""A module's route preferences: one frozen :class:`floatxq.dispatch.RoutePreference` record."""

from floatxq.dispatch import RoutePreference


class RoutePreferenceHolder:
    """Mixin: ``route_preference`` (a frozen record) with a type check; assigning one calls
    :meth:`_preference_changed` (a module drops what it cached from the old one)."""

    @property
    def route_preference(self) -> RoutePreference:
        """This module's :class:`floatxq.dispatch.RoutePreference` (a frozen record)."""
        return self.__dict__["_route_preference"]

    @route_preference.setter
    def route_preference(self, value: RoutePreference) -> None:
        if not isinstance(value, RoutePreference):
            raise TypeError(
                f"{type(self).__name__}.route_preference must be a RoutePreference, got "
                f"{type(value).__name__}"
            )
        self.__dict__["_route_preference"] = value
        self._preference_changed()

    def _preference_changed(self) -> None:
        """Called after a new record is assigned (nothing cached by default)."""
