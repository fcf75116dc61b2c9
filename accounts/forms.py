from django import forms


class ApiKeyForm(forms.Form):
    name = forms.CharField(
        max_length=100,
        help_text="What the key is for, e.g. “notebook” or “nightly job”.",
    )
