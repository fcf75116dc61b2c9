from django.contrib import admin

from .models import ApiKey


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["name", "user", "prefix", "created_at", "last_used_at", "last_used_ip", "expires_at", "revoked_at"]
    list_filter = ["revoked_at"]
    search_fields = ["user__username", "name", "prefix"]
    # The scope changes only through the audited key page (budgets.actions.do_set_key_caps).
    readonly_fields = ["user", "prefix", "hashed_key", "created_at", "last_used_at", "last_used_ip", "rotated_from",
                       "allowed_features"]

    def has_add_permission(self, request) -> bool:
        # A key's plaintext is shown once by whoever creates it: the keys page or create_api_key.
        return False
