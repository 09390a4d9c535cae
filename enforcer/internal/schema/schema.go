// Package schema validates RateLimitPolicy objects that never pass through the API server, such
// as a standalone enforcer's policy file, with the API server's own validators over the CRD that
// `make manifests` generates: structural defaulting, the OpenAPI schema, metadata, list types and
// the CEL rules, in the order in which the API server applies them on create. Nothing here
// restates the schema, so a file is refused exactly when `kubectl apply` would be.
package schema

import (
	"context"
	"fmt"
	"sync"

	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	structuralschema "k8s.io/apiextensions-apiserver/pkg/apiserver/schema"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/cel"
	structuraldefaulting "k8s.io/apiextensions-apiserver/pkg/apiserver/schema/defaulting"
	structurallisttype "k8s.io/apiextensions-apiserver/pkg/apiserver/schema/listtype"
	schemaobjectmeta "k8s.io/apiextensions-apiserver/pkg/apiserver/schema/objectmeta"
	structuralpruning "k8s.io/apiextensions-apiserver/pkg/apiserver/schema/pruning"
	apiservervalidation "k8s.io/apiextensions-apiserver/pkg/apiserver/validation"
	"k8s.io/apimachinery/pkg/api/operation"
	"k8s.io/apimachinery/pkg/api/validation"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/validation/field"
	celconfig "k8s.io/apiserver/pkg/apis/cel"
	"sigs.k8s.io/yaml"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/config/crd"
)

// validators are built once from the embedded CRD.
type validators struct {
	structural *structuralschema.Structural
	schema     apiservervalidation.SchemaValidator
	cel        *cel.Validator
}

var load = sync.OnceValues(func() (*validators, error) {
	var def apiextensionsv1.CustomResourceDefinition
	if err := yaml.UnmarshalStrict(crd.RateLimitPolicies, &def); err != nil {
		return nil, fmt.Errorf("decode the embedded CRD: %w", err)
	}
	for _, v := range def.Spec.Versions {
		if v.Name != v1alpha1.GroupVersion.Version {
			continue
		}
		var internal apiextensions.JSONSchemaProps
		if err := apiextensionsv1.Convert_v1_JSONSchemaProps_To_apiextensions_JSONSchemaProps(v.Schema.OpenAPIV3Schema, &internal, nil); err != nil {
			return nil, fmt.Errorf("convert the CRD's schema: %w", err)
		}
		structural, err := structuralschema.NewStructural(&internal)
		if err != nil {
			return nil, fmt.Errorf("the CRD's schema is not structural: %w", err)
		}
		sv, _, err := apiservervalidation.NewSchemaValidator(&internal)
		if err != nil {
			return nil, fmt.Errorf("build the CRD's schema validator: %w", err)
		}
		return &validators{structural: structural, schema: sv, cel: cel.NewValidator(structural, true, celconfig.PerCallLimit)}, nil
	}
	return nil, fmt.Errorf("the embedded CRD has no version %s", v1alpha1.GroupVersion.Version)
})

// Validate validates a RateLimitPolicy object, decoded into maps and slices as from JSON, as the
// API server validates it on create. Like the API server, it first sets the schema's defaults,
// in obj itself. The errors name the fields as the API server would.
func Validate(ctx context.Context, obj map[string]any) field.ErrorList {
	v, err := load()
	if err != nil {
		return field.ErrorList{field.InternalError(nil, err)}
	}
	structuraldefaulting.Default(obj, v.structural)

	var errs field.ErrorList
	errs = append(errs, validateMetadata(ctx, obj)...)
	errs = append(errs, apiservervalidation.ValidateCustomResource(nil, obj, v.schema)...)
	errs = append(errs, schemaobjectmeta.Validate(ctx, nil, obj, v.structural, false)...)
	errs = append(errs, structurallisttype.ValidateListSetsAndMaps(nil, v.structural, obj)...)
	// As the API server: CEL rules run only on an object whose shape holds, since they may
	// assume it.
	for _, e := range errs {
		switch e.Type {
		case field.ErrorTypeNotSupported, field.ErrorTypeRequired, field.ErrorTypeTooLong, field.ErrorTypeTooMany, field.ErrorTypeTypeInvalid:
			return errs
		}
	}
	celErrs, _ := v.cel.Validate(ctx, nil, v.structural, obj, nil, celconfig.RuntimeCELCostBudget)
	return append(errs, celErrs...)
}

// UnknownFields returns the paths of the fields of obj that the CRD's schema does not know, as
// the API server finds them under strict field validation (kubectl's default): metadata's, then
// the rest of the object's, pruned from obj.
func UnknownFields(obj map[string]any) []string {
	v, err := load()
	if err != nil {
		return nil // Validate reports it
	}
	_, _, unknown, err := schemaobjectmeta.GetObjectMetaWithOptions(obj, schemaobjectmeta.ObjectMetaOptions{ReturnUnknownFieldPaths: true})
	if err != nil {
		return nil // malformed metadata: Validate names it
	}
	return append(unknown, structuralpruning.PruneWithOptions(obj, v.structural, true, structuralschema.UnknownFieldPathOptions{TrackUnknownFieldPaths: true})...)
}

// validateMetadata applies the API server's checks of a namespaced custom resource's metadata:
// a name that is a DNS subdomain, a namespace that is a DNS label, labels and annotations.
func validateMetadata(ctx context.Context, obj map[string]any) field.ErrorList {
	path := field.NewPath("metadata")
	meta := &metav1.ObjectMeta{}
	if raw, ok := obj["metadata"].(map[string]any); ok {
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(raw, meta); err != nil {
			return field.ErrorList{field.Invalid(path, raw, err.Error())}
		}
	} else if obj["metadata"] != nil {
		return field.ErrorList{field.Invalid(path, obj["metadata"], "must be an object")}
	}
	return validation.ValidateObjectMetaDeclaratively(ctx, operation.Create, meta, nil, true, validation.NameIsDNSSubdomain, path, false)
}
