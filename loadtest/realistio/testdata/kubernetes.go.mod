// A shortened k8s.io/kubernetes go.mod (v1.35.4's shape).
module k8s.io/kubernetes

go 1.25.0

require (
	k8s.io/api v0.0.0
	k8s.io/client-go v0.0.0
	sigs.k8s.io/yaml v1.6.0
)

replace (
	k8s.io/api => ./staging/src/k8s.io/api
	k8s.io/client-go => ./staging/src/k8s.io/client-go
)

replace k8s.io/kms => ./staging/src/k8s.io/kms

replace sigs.k8s.io/yaml => sigs.k8s.io/yaml v1.6.0
